"""Code that patched SGLang imports at run time.

Upstream files carry thin seams that call into this package, so the
hardening logic is written and tested once, whatever the base release.
Nothing here may import SGLang at module level: a seam is called from
inside SGLang's own import graph.
"""

# Upstream's PD warm-up requests carry this bootstrap host: no peer, no transfer.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def abort_before_decode(decode_req, reason: str) -> None:
    """Abort a transferred request before its first decode step, the way decode's
    `_commit_transfer_to_req` aborts a room mismatch (500; upstream then frees its pages)."""
    from http import HTTPStatus

    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(decode_req.req, reason, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
    decode_req.kv_receiver.clear()
    decode_req.kv_receiver = None
