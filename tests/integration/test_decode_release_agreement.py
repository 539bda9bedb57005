"""Decode's deferred releases across two tensor-parallel ranks, run in upstream's own
``resolve_deferred_releases`` (and ``_defer_release``) as each base ships it and as the
hardened series leaves it, on two real gloo ranks. Rank 0 has its prefill rank's drain ack,
rank 1 not yet: upstream 0.5.19-0.5.22 free on rank 0 alone, and the ranks' free pools part
(0.5.23 all-reduces; patch 0033 does the same on the bases before). The methods are taken
from the wheel's source and run on a stand-in queue: the rest of decode needs a model."""

from __future__ import annotations

import ast
import logging
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch

from sglang_hardened.pipeline import unidiff
from sglang_hardened.pipeline.fetch import fetch_wheel
from sglang_hardened.pipeline.lock import get_pin
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.wheelfile import read_members
from sglang_hardened.runtime import rank_agreement
from tests.integration.test_rank_agreement import on_ranks

DECODE = "sglang/srt/disaggregation/decode.py"
UTILS = "sglang/srt/disaggregation/utils.py"  # 0.5.23's all_reduce_flags
METHODS = ("_defer_release", "resolve_deferred_releases")


def _queue_class(source: str, utils: str) -> type:
    """DecodeTransferQueue's two release methods, compiled from ``source`` alone (with the
    base's all_reduce_flags, where it has one)."""
    helpers = [n for n in ast.parse(utils).body if isinstance(n, ast.FunctionDef) and n.name == "all_reduce_flags"]
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DecodeTransferQueue"]
    body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    assert {f.name for f in body} == set(METHODS)
    module = ast.Module(body=[*helpers, ast.ClassDef("Queue", [], [], body, [], type_params=[])], type_ignores=[])
    scope = {
        "dist": dist,
        "List": list,
        "time": time,
        "torch": torch,
        "logger": logging.getLogger("decode"),
        "hardened_release_guard": SimpleNamespace(writers_settled=lambda _receiver: True),
        "hardened_rank_agreement": rank_agreement,
        "DecodeRequest": object,
    }
    exec(compile(ast.fix_missing_locations(module), DECODE, "exec"), scope)
    return scope["Queue"]


def _sources(patches, base: str) -> dict[str, str]:
    series = load_series(patches, base).patches
    touched = {UTILS} | {fp.target for p in series for fp in unidiff.parse(p.diff)}
    upstream = read_members(fetch_wheel(get_pin(patches, base)), touched)
    hardened = upstream
    for patch in series:
        hardened, _ = unidiff.apply_to_files(hardened, patch.diff)
    return {"upstream": upstream[DECODE], "hardened": hardened[DECODE], "utils": upstream[UTILS] or ""}


def _two_passes(source: str, utils: str, acked_in: tuple[int | None, int | None], notified=(True, True)):
    """What each rank released after each of two passes; rank k's drain ack arrives before pass
    ``acked_in[k]`` (None: never). A rank not ``notified`` sent no ABORT and never bootstrapped:
    it holds only because the other rank must."""

    def job(rank: int, group: dist.ProcessGroup) -> list[list[str]]:
        acks = {"got": 0}
        manager = SimpleNamespace(is_abort_release_safe=lambda _room, required: acks["got"] >= required)
        receiver = SimpleNamespace(kv_mgr=manager, abort_notified=notified[rank],
                                   bootstrap_infos=[{}] if notified[rank] else None,
                                   is_abort_release_safe=lambda: acks["got"] >= 1)
        req = SimpleNamespace(req=SimpleNamespace(bootstrap_room=7, rid="r"), kv_receiver=receiver,
                              metadata_buffer_index=3, host_staged=False)
        freed: list[str] = []
        queue = _queue_class(source, utils)()
        queue.__dict__.update(
            gloo_group=group, _deferred_releases=[], deferred_kv_release_timeout=30.0,
            enable_host_receive=False, _is_host_destination=lambda _r: False,
            _do_release=lambda r, _idx: freed.append(r.req.rid),
            _observe_deferred_kv_release=lambda **_kw: None,
        )
        queue._defer_release(req)
        passes = []
        for n in range(2):
            acks["got"] = int(acked_in[rank] is not None and n >= acked_in[rank])
            queue.resolve_deferred_releases()
            passes.append(list(freed))
        return passes

    return on_ranks(job)


@pytest.fixture(scope="module")
def sources(patches, bases) -> dict[str, dict[str, str]]:
    return {base: _sources(patches, base) for base in bases}


def test_upstream_before_0_5_23_frees_on_one_rank_alone(sources):
    for base in ("0.5.19", "0.5.22"):
        rank0, rank1 = _two_passes(sources[base]["upstream"], sources[base]["utils"], (0, 1))
        assert rank0[0] == ["r"] and rank1[0] == [], f"{base}: the divergence this test guards against"


@pytest.mark.parametrize("base", ["0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"])
def test_a_hold_ends_on_every_rank_together(sources, base):
    rank0, rank1 = _two_passes(sources[base]["hardened"], sources[base]["utils"], (0, 1))
    assert rank0 == rank1 == [[], ["r"]], f"{base}: rank 0 {rank0}, rank 1 {rank1}"


@pytest.mark.parametrize("base", ["0.5.19", "0.5.22", "0.5.23"])
def test_a_rank_holding_only_for_another_waits_for_that_ranks_ack(sources, base):
    """Rank 1's receiver never bootstrapped (so sent no ABORT) when the transfer failed; it
    holds because rank 0 must. It awaits no ack of its own (0.5.19's hold asked for one per
    bootstrap entry it does not have, and failed), and frees when rank 0's ack comes."""
    rank0, rank1 = _two_passes(sources[base]["hardened"], sources[base]["utils"], (1, None), (True, False))
    assert rank0 == rank1 == [[], ["r"]], f"{base}: rank 0 {rank0}, rank 1 {rank1}"


@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True)])
def test_a_failed_transfer_is_held_on_every_rank_if_any_rank_must(flags):
    got = on_ranks(lambda rank, group: rank_agreement.hold_anywhere(flags[rank], group))
    assert got == [any(flags)] * 2
