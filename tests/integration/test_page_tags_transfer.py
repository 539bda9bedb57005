"""H8 tags really travel: two processes, real Mooncake over TCP or real NIXL over UCX (DRAM) on
127.0.0.1, the rows moved from prefill's tag buffer into decode's as one more registered buffer
(NIXL: through the runtime's own `page_tags.nixl` adapters)."""

from __future__ import annotations

import json
import subprocess

import pytest

from sglang_hardened.sandbox.env import build_env, wheels_for
from tests.harness import REPO

TESTS = REPO / "tests"
PEER = TESTS / "page_tags" / "peer.py"
ROOM_A, ROOM_B = 2**63 - 1, 41  # the largest room SGLang draws, and a small one

PLAN = {"pages": 16, "requests": [
    {"room": ROOM_A, "dst": [3, 4, 5, 8], "src": [0, 1, 2, 10], "sent": [0, 1, 2, 3]},  # two runs
    {"room": ROOM_B, "dst": [9, 12], "src": [6, 7], "sent": [0]},  # its second page is lost
]}


def exchange(backend: str, plan: dict) -> tuple[dict, dict]:
    """Run decode and prefill peers on `plan`: (decode's line to prefill, decode's checks)."""
    env = build_env("0.5.23", wheels_for("0.5.23", hardened=False), TESTS / "cpu_overlay")  # cached
    environ = env.environ() | {"MC_FORCE_TCP": "1"}
    environ["PYTHONPATH"] = f"{TESTS.parent}:{environ['PYTHONPATH']}"  # this checkout's runtime layer
    peer = [str(env.python), str(PEER), backend]
    with subprocess.Popen(peer + ["decode", json.dumps(plan)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=environ, cwd=TESTS) as decode:
        try:
            where = decode.stdout.readline()
            assert where, decode.stderr.read()[-2000:] if decode.poll() is not None else "decode said nothing"
            sent = subprocess.run(peer + ["prefill", json.dumps(plan)], input=where, capture_output=True,
                                  text=True, env=environ, cwd=TESTS, timeout=60)
            assert json.loads(sent.stdout or "{}") == {"rc": 0}, sent.stderr[-2000:]
            decode.stdin.write("done\n")
            decode.stdin.flush()
            return json.loads(where), json.loads(decode.stdout.readline())
        finally:
            decode.kill()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_tag_rows_cross_processes_and_a_lost_page_is_caught(backend):
    where, result = exchange(backend, PLAN)
    epochs = where["epochs"]
    assert result["rows"][str(ROOM_A)] == [[ROOM_A, epochs[str(ROOM_A)]]] * 4
    assert result["rows"][str(ROOM_B)] == [[ROOM_B, epochs[str(ROOM_B)]], [-1, -1]]
    ok, lost = result["verdicts"]
    assert ok is None
    assert f"room={ROOM_B} epoch={epochs[str(ROOM_B)]}: 1 of its 2 pages" in lost


# Two requests whose prompts share three cached prefix pages (prefill pages 0-2), sent by two
# transfer workers (two decode ranks or instances): each decode page gets its own request's tag.
SHARED_PREFIX = {"pages": 16, "requests": [
    {"room": ROOM_A, "dst": [3, 4, 5, 6], "src": [0, 1, 2, 7], "sent": [0, 1, 2, 3]},
    {"room": ROOM_B, "dst": [9, 10, 11, 12], "src": [0, 1, 2, 8], "sent": [0, 1, 2, 3]},
]}


@pytest.mark.parametrize("backend, race", [("mooncake", "workers"), ("nixl", "workers"), ("nixl", "queued")])
def test_h8_false_refusal_under_a_shared_prefix(backend, race):
    """A review finding: the second request's stamp on the shared prefix pages lands between the first one's
    stamp and its write (two workers; or NIXL 0.5.23's one worker, the first write still queued);
    the first request, correct, must still be admitted."""
    where, result = exchange(backend, SHARED_PREFIX | {"race": race})
    epochs = where["epochs"]
    assert result["verdicts"] == [None, None], result["verdicts"]
    for room in (ROOM_A, ROOM_B):
        assert result["rows"][str(room)] == [[room, epochs[str(room)]]] * 4


# Prefill TP 2 to decode TP 1 on a model with two KV heads: each prefill rank writes one head's slice
# of every page (upstream's head-sliced sender) and its slot of decode's row. The second request's
# last page lost rank 1's slice only: rank 0's slot vouches for it, rank 1's does not.
SLICED = {"pages": 16, "heads": 2, "requests": [
    {"room": ROOM_A, "dst": [3, 4, 5], "src": [0, 1, 2], "sent": [[0, 1, 2], [0, 1, 2]]},
    {"room": ROOM_B, "dst": [9, 12], "src": [6, 7], "sent": [[0, 1], [0]]},
]}


def test_head_sliced_transfers_vouch_for_each_rank_s_slice():
    """Between unequal TP sizes every prefill rank's head slice carries its own tag slot, so a
    page is admitted when all its slices landed and refused when one rank's did not (before, every
    such transfer was refused: the slices carried no tags)."""
    where, result = exchange("mooncake", SLICED)
    epochs = {int(room): epoch for room, epoch in where["epochs"].items()}
    ok, lost = result["verdicts"]
    assert ok is None, ok
    assert f"room={ROOM_B} epoch={epochs[ROOM_B]}: 1 of its 2 pages" in lost
    assert result["rows"][str(ROOM_A)] == [[ROOM_A, epochs[ROOM_A]] * 2] * 3
    assert result["rows"][str(ROOM_B)] == [[ROOM_B, epochs[ROOM_B]] * 2, [ROOM_B, epochs[ROOM_B], -1, -1]]
