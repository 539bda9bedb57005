"""H13: a transfer prefill reported done, whose metadata never reaches decode, ends with a 500.

Decode commits a transfer only once its metadata row (the first output token, the bootstrap
room) has landed: upstream's metadata gate (``disaggregation/utils.py``
``_apply_metadata_gate``, the same on 0.5.19-0.5.23) holds a receiver's Success back as
Transferring while the row's room is still 0, and nothing times that out. The row is written
before prefill reports Success (Mooncake's RDMA write) or sent ahead of it on the same
connection (the TCP aux path: NVLink pools, ``SGLANG_MOONCAKE_SEND_AUX_TCP``), so a row that
has not landed by then never will: decode drops an AUX_DATA frame whose length field does not
match what arrived (``_handle_aux_data``). The request then never answers, and its decode
slot and pages stay held, which starves later admission (sgl-project/sglang#31800 reports that
slot leak; its receiver-side timeout does not reach this hold).

Hardened, the gate holds a request for at most decode's release timeout
(SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT, 30 s by default: the house's bound on
a write that may still land, ``release_timeout.py``), counted from the first hold, not the
waiting timeout sgl-project/sglang#31800 uses (300 s by default, sized for prefill's queue and compute: once
prefill reported Success, only a write is left). Then its receiver concludes Failed with the
cause, and upstream's failure path answers 500 naming it and releases the pages (through H5's
release guard).
"""

from __future__ import annotations

import time
from typing import Any

from . import metrics
from .release_timeout import RELEASE_TIMEOUT_ENV, process_release_timeout_s

HELD_SINCE = "hardened_metadata_held_since"  # set on upstream's DecodeRequest at the first hold
MESSAGE = ("sglang-hardened H13: prefill reported the KV transfer of bootstrap room {room} done, but "
           "its metadata (first token, room) did not reach decode within {waited:.0f} s "
           f"({RELEASE_TIMEOUT_ENV}); the request is ended instead of held for ever")


def held(decode_req: Any, kv_poll: Any, now: float | None = None) -> int:
    """The poll value for a concluded transfer whose metadata row has not landed: upstream's
    ``kv_poll.Transferring`` while decode's release timeout has not run out since the first
    hold, then ``kv_poll.Failed``, with the cause recorded where the receiver's
    ``failure_exception`` reads it (the 500's text)."""
    now = time.monotonic() if now is None else now
    since = vars(decode_req).setdefault(HELD_SINCE, now)
    if now - since < process_release_timeout_s():
        return int(kv_poll.Transferring)
    receiver = decode_req.kv_receiver
    room = receiver.bootstrap_room
    receiver.kv_mgr.record_failure(room, MESSAGE.format(room=room, waited=now - since))
    receiver.conclude_state = kv_poll.Failed
    metrics.refused("H13", "decode", "metadata_lost")
    return int(kv_poll.Failed)
