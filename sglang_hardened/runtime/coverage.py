"""H3: decode never decodes over KV pages its own transfer did not write.

Decode allocates pages for the prompt as it sees it and reads every one of
them; prefill writes the pages for the prompt as *it* saw it. Upstream
checks only that the metadata came from the right room, so when the two
differ (0.5.19's one-token placeholder for an oversized prompt, or
`--allow-auto-truncate` with different input limits on the two roles) decode
reads pages still holding earlier requests' KV, with no error.

Prefill stamps, next to the room in the request's metadata row (spare slots
of the same transferred buffer, as upstream reuses spare `cached_tokens`
slots), how many prompt tokens it computed KV for; decode compares that with
its own prompt length before the request's first decode step and refuses a
request whose pages the transfer did not all cover. No stamp (an unhardened
prefill) is a refusal too. The sender side fails a transfer outright when
decode expects more pages than prefill will send.
"""

from __future__ import annotations

import logging

from . import metrics
from .page_tags.seams import release as forget_page_tags
from .rank_agreement import refused_elsewhere
from .refusal import abort_before_decode
from .warmup import FAKE_BOOTSTRAP_HOST

# Slots 1 and 2 of the metadata's bootstrap_room row (slot 0 is the room).
STAMP_MAGIC = 0x4833_434F_5645_5231  # "H3COVER1": tells a stamp from a zeroed or stale slot
MAGIC_SLOT, TOKENS_SLOT = 1, 2

# The sender's refusal: numbers only besides fixed text, so H4 may pass it on to decode as is.
SHORTFALL = ("sglang-hardened H3: room {room}: decode expects {expects} pages but prefill sends {sends}; "
             "the transfer is failed rather than leave decode pages unwritten")
OTHER_RANK = ("sglang-hardened H3: request room={room}: the transfer to another tensor-parallel rank of this "
              "decode did not cover every prompt page (that rank refused it, and its log says why); every "
              "rank aborts it, so the ranks stay in step")

log = logging.getLogger("sglang_hardened")
refused_total = 0  # requests decode refused for uncovered pages, in this process


def stamp(row, req) -> None:
    """Seam in prefill's `MetadataBuffers.set_buf`: state the prompt tokens this transfer covers."""
    row[MAGIC_SLOT] = STAMP_MAGIC
    row[TOKENS_SLOT] = len(req.origin_input_ids)


def uncovered_reason(req, row) -> str | None:
    """Why decode must not read `req`'s pages after this transfer, or None when they are covered."""
    if req.bootstrap_host == FAKE_BOOTSTRAP_HOST:
        return None
    decode_tokens = len(req.origin_input_ids)
    if int(row[MAGIC_SLOT]) != STAMP_MAGIC:
        return (f"sglang-hardened H3: request {req.rid} (room {req.bootstrap_room}): the prefill did "
                f"not state how many prompt tokens its transfer covers (an unhardened prefill?), "
                f"so {decode_tokens} tokens of KV cannot be trusted; refused before decoding")
    prefill_tokens = int(row[TOKENS_SLOT])
    if prefill_tokens == decode_tokens:
        return None
    return (f"sglang-hardened H3: request {req.rid} (room {req.bootstrap_room}): prefill computed KV "
            f"for {prefill_tokens} prompt tokens but this decode holds the prompt as {decode_tokens} "
            f"tokens, so some of its pages were not written by this request's transfer; refused "
            f"before decoding. Usual cause: different input limits or --allow-auto-truncate on the "
            f"two roles")


def refuse_uncovered(transfer_queue, decode_req, row) -> bool:
    """Seam in decode's `_commit_transfer_to_req`, after upstream's room check: abort an
    uncovered request the way upstream aborts a room mismatch (True: caller returns). Each
    tensor-parallel rank reads the row its own transfer brought; one verdict for all of them,
    since a rank returning here alone would skip H8's agreement the others wait in."""
    global refused_total
    req = decode_req.req
    if req.bootstrap_host == FAKE_BOOTSTRAP_HOST:
        return False
    reason = uncovered_reason(req, row)
    if refused_elsewhere(reason is not None, transfer_queue):
        reason = OTHER_RANK.format(room=req.bootstrap_room)
        metrics.refused("H3", "decode", "another_rank")
    elif reason is not None:
        metrics.refused("H3", "decode", "unstated_coverage" if int(row[MAGIC_SLOT]) != STAMP_MAGIC
                        else "prompt_length_differs")
    if reason is None:
        return False
    refused_total += 1
    log.error("%s (refused so far: %d)", reason, refused_total)
    # upstream frees a request aborted here by _release_request, which H8's seam in _do_release
    # never sees: forget its tag allocation here, or it stays for the process's life
    forget_page_tags(decode_req)
    abort_before_decode(decode_req, reason)
    return True


def sender_shortfall(kv_chunk, dst_pages: int) -> str | None:
    """Why a last chunk leaves decode pages unwritten (decode expects more pages than
    prefill sends; upstream trims only the other direction), or None."""
    sent = kv_chunk.index_slice.stop
    if not kv_chunk.is_last_chunk or sent is None or sent >= dst_pages:
        return None
    return SHORTFALL.format(room=kv_chunk.room, expects=dst_pages, sends=sent)


def fail_short_transfer(manager, kv_chunk, dst) -> bool:
    """Seam in the Mooncake transfer worker, per destination: fail the room the way the base
    fails a transfer, when this chunk would leave decode pages unwritten (True: skip it)."""
    reason = sender_shortfall(kv_chunk, len(dst.dst_kv_indices))
    if reason is None:
        return False
    log.error(reason)
    metrics.refused("H3", "prefill", "sender_shortfall")
    if hasattr(manager, "conclude_failure"):  # 0.5.20 on: records, marks Failed, tells decode
        # with the reason: upstream's switch for it (NIXL's is on) is off for Mooncake, and decode
        # would tell its client that prefill "might be dead"; from here on, this manager's
        # failures all carry theirs
        manager.kv_status_msg_carries_reason = True
        manager.conclude_failure(bootstrap_room=kv_chunk.room, failure_reason=reason)
        return True
    # 0.5.19: prefill fails the request (its client gets the reason); decode hears of it
    # through H4, or its waiting timeout, and never sees the room succeed.
    from sglang.srt.disaggregation.base.conn import KVPoll

    manager.record_failure(kv_chunk.room, reason)
    manager.update_status(kv_chunk.room, KVPoll.Failed)
    return True
