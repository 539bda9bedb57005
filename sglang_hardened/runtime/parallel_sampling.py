"""H11: a request for several samples (n > 1) is refused on a PD server, with its cause.

Upstream serves n > 1 by sending a prefix warm-up and then n samples, every one a copy of
the request with its one bootstrap room (``TokenizerManager._handle_batch_request``,
0.5.19-0.5.23). On a PD pair the samples' transfers collide in that room: decode waits for
transfers that never come, holds the pages it gave them past every timeout, and the client
waits for ever, so any client can take decode's pool away a few pages at a time, and a
room's late write can land after its pages went to someone else. Upstream's fixes (sglang#24223,
sglang#26486, sglang#30723, which give each sample a room of its own) are not merged; until one is
carried, a refusal (400) says what to do instead: send n requests with n = 1.
"""

from __future__ import annotations

from . import metrics

PD_MODES = ("prefill", "decode")
MESSAGE = ("sglang-hardened H11: parallel sampling (n > 1) is refused on a prefill/decode "
           "disaggregated server: upstream gives every sample the request's one bootstrap room, so "
           "their transfers collide and the request hangs holding KV pages (upstream #30723, "
           "unmerged). Send n requests with n = 1 instead.")


def refuse_in_pd(disaggregation_mode: object) -> None:
    """Raise ValueError (SGLang answers 400 with its text) on a prefill or decode server."""
    if (mode := getattr(disaggregation_mode, "value", disaggregation_mode)) in PD_MODES:
        metrics.refused("H11", str(mode), "parallel_sampling")
        raise ValueError(MESSAGE)
