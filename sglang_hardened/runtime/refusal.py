"""How a hardened check on decode refuses a transferred request before its first decode step."""

from __future__ import annotations


def abort_before_decode(decode_req, reason: str) -> None:
    """Abort a transferred request before its first decode step, the way decode's
    `_commit_transfer_to_req` aborts a room mismatch (500; upstream then frees its pages)."""
    from http import HTTPStatus

    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(decode_req.req, reason, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
    decode_req.kv_receiver.clear()
    decode_req.kv_receiver = None
