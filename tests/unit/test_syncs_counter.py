"""The overlay's syncs counter (tests/cpu_overlay/site/sgl_syncs.py) on real torch ops: what it
counts as a host-device synchronisation, and to which seam it gives each."""

from __future__ import annotations

import torch

from sglang_hardened.runtime.page_tags.rows import DecodePageTags
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


def test_h8s_check_on_the_torch_path_a_gpu_runs_waits_for_nothing_on_decodes_loop(monkeypatch):
    """What CUDA runs for H8's check on decode's loop (the torch row path; the CPU servers run
    numpy views): the gather and compares queued on the device, the count copied to host memory
    behind an event, and once the event has completed, the count read from host memory: nothing
    counted, refused or not. The verdict read on the host as it was before (``bool`` of the
    compare on the device) is one wait, and the counter sees it."""
    monkeypatch.setattr(syncs, "_counts", {})
    tags = DecodePageTags(16, path="torch")
    epoch = tags.allocate(5, [0, 1, 2, 3])
    tags.buffer.stamp([0, 1, 2], 5, epoch)
    with syncs.counted():
        for pages in ([0, 1, 2], [0, 1, 2, 3]):
            count = tags.start_check(5, torch.tensor(pages, dtype=torch.int32))
            assert count.ready() and (tags.verdict(5, count) is None) == (len(pages) == 3)
    assert counts() == {}
    idx = torch.arange(4)
    with syncs.counted():
        assert not bool(tags.buffer.ops.matching(idx, 5, epoch).all())
    assert counts() == {("item", "upstream"): 1}
