"""The overlay's syncs counter (tests/cpu_overlay/site/sgl_syncs.py) on real torch ops: what it
counts as a host-device synchronisation, and to which seam it gives each."""

from __future__ import annotations

import numpy as np
import torch

from sglang_hardened.runtime.page_tags.rows import TAG_WORDS, TorchRows
from sglang_hardened.sandbox.env import overlay_module

syncs = overlay_module("sgl_syncs")


def counts() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for c in syncs.snapshot()["counts"]:
        found[c["kind"], c["owner"]] = found.get((c["kind"], c["owner"]), 0) + c["calls"]
    return found


def test_reads_of_values_on_the_host_are_counted_and_other_ops_are_not(monkeypatch):
    monkeypatch.setattr(syncs, "_counts", {})
    t = torch.arange(8)
    with syncs.counted():
        t.add(1).mul(2)  # queued on a GPU: no wait
        t.sum().item()
        bool(t.eq(3).any())
        torch.equal(t, t.clone())
        t.nonzero()
        t.tolist()
        t.cpu()
    t.tolist()  # outside: not counted
    assert counts() == {("item", "upstream"): 2, ("equal", "upstream"): 1, ("nonzero", "upstream"): 1,
                        ("copy", "upstream"): 2}
    assert not hasattr(torch.Tensor.tolist, "__wrapped__"), "the copy methods are put back"


def test_h8s_check_on_the_torch_path_a_gpu_runs_is_one_sync_given_to_its_seam(monkeypatch):
    """What CUDA runs for H8's check (TorchRows; the CPU servers run numpy views): one wait per
    request, its verdict read on the host, counted as the runtime's (before, torch.equal's, and a
    row made on the host and copied to the device, which waits for the stream too)."""
    monkeypatch.setattr(syncs, "_counts", {})
    rows = torch.full((16, TAG_WORDS), 0, dtype=torch.int64)
    rows[:, 0], rows[:, 1] = 5, 9
    ops = TorchRows(rows)
    idx = ops.gather_index(torch.arange(4, dtype=torch.int32))
    with syncs.counted():
        assert ops.bad_pages(idx, 5, 9) == 0
    assert counts() == {("item", "page_tags.rows.bad_pages"): 1}
    assert np.array_equal(rows[:, 1].numpy(), np.full(16, 9))
