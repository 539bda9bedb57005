"""H6/H5 on Mooncake: the calls of one chunk stop once its room failed.

H6 bounds each transfer call; a chunk becomes many calls in a row. Decode's release guard
gives a failed room's pages back once prefill has run for a release timeout past decode's
own, which holds only if no call for that room starts after prefill learned of the failure.
Here a chunk is made of thousands of tiny calls (a link rate of a few bytes a second) so that
it outlasts decode's two timeouts, decode is aborted mid-chunk, and the page ledger judges
whether a page went back while the chunk's writes still landed; the stopped send must not
read as a transport failure either (decode's hold ends on prefill's drain ack, not on its
timeout). Cost: one cluster start (about 25 s) and one request of a few seconds.
"""

from __future__ import annotations

import uuid

import pytest

from sglang_hardened.common.knobs import TRANSFER_LINK_RATE, TRANSFER_MAX_ENTRIES
from sglang_hardened.runtime.release_timeout import RELEASE_TIMEOUT_ENV
from sglang_hardened.sandbox.ledger import Ledger, wait_for, writer

from .conftest import sandbox_env
from .inflight import abort_request, send_mid_transfer
from .scenarios import SAFE_PARAMS, wait_pages_idle

pytestmark = pytest.mark.e2e

RELEASE_TIMEOUT_S = 2  # decode frees a held room after this, and this again of prefill running
LINK_RATE = 2  # bytes/s: each call carries 2 bytes (the timeout's half at this rate): tens of thousands of calls
CHUNK_ENV = (f"{RELEASE_TIMEOUT_ENV}={RELEASE_TIMEOUT_S}", f"{TRANSFER_LINK_RATE.name}={LINK_RATE}", f"{TRANSFER_MAX_ENTRIES.name}=1")


def test_a_chunks_calls_stop_once_decode_aborted_its_room(start_cluster, tmp_path):
    """Review finding (high): on main the chunk's calls went on after decode's abort, and decode
    gave the pages back under them."""
    cluster = start_cluster(sandbox_env("0.5.23", hardened=True), backend="mooncake",
                            **dict(SAFE_PARAMS, decode_pool_tokens=2600),
                            extra_env=(f"{writer.DIR_ENV}={tmp_path}", *CHUNK_ENV))
    idle = cluster.used_tokens()
    req = send_mid_transfer(cluster, tmp_path, uuid.uuid4().hex)
    req.read_answers(120)
    abort_request(cluster, "decode", req.rid)
    end = wait_for(tmp_path, "end", timeout_s=120, after=req.sent_at)
    assert wait_pages_idle(cluster, idle) == idle, "pages leaked"
    ledger = Ledger(tmp_path)
    unsafe = [u for u in ledger.unsafe_frees() if u.room == req.room]
    ran_s = end["t"] - min(e["t"] for e in ledger.of("begin") if e["room"] == req.room)
    print(f"\nchunk of room {req.room}: calls ran {ran_s:.1f} s; {len(unsafe)} pages freed under them")
    assert not unsafe, "\n".join(map(str, unsafe[:5]))
    # the ledger's engine calls, not the runtime's word: the chunk's calls ended with its write
    # (none for the room after it), within the wait above, hours before its bytes could all go
    calls = ledger.calls(req.room)
    assert calls and max(c["t"] for c in calls) <= end["t"], "a call for the room ran after its write ended"
    assert "0.5.23's asynchronous branch" in cluster.log_tail("prefill", 10**9), \
        "prefill sent through the index-copy branch GPUs take (tests/cpu_overlay/site/sgl_cpu_event.py)"
    no_ack = f"room {req.room}: no drain ack by the release timeout"
    assert no_ack not in cluster.log_tail("decode", 10**9), "the stopped send lost prefill's drain ack"

