"""Requests the tokenizer manager refuses as longer than the model's context, counted.

SGLang's tokenizer manager refuses a prompt at or over the context length (and, with
``--validate-total-tokens``, a prompt whose ``max_new_tokens`` would run past it) with a 400
before the request reaches a scheduler or any other seam. Where H7 holds (every pool at least
the context), every prompt over prefill's KV pool is such a prompt, so without this count the
incident's shape was refused and no refusal counter moved. Counted on the role the server
plays (``api`` for a server outside PD), in its HTTP process: once per refusal whatever its
tensor-parallel size.
"""

from __future__ import annotations

from . import metrics

def role_of(tokenizer_manager) -> str:
    """``prefill`` or ``decode`` in PD, else ``api``."""
    mode = getattr(getattr(tokenizer_manager, "disaggregation_mode", None), "value", None)
    return mode if mode in ("prefill", "decode") else "api"


def validate_one_request(tokenizer_manager, obj, input_ids) -> None:
    """Seam for the tokenizer manager's ``self._validate_one_request(obj, input_ids)``: upstream's
    check, as it is, its context-length refusals counted (H1, ``over_context`` and
    ``over_context_with_output``) before they go on as the 400 they were."""
    try:
        tokenizer_manager._validate_one_request(obj, input_ids)
    except ValueError as e:  # upstream's words, the same on every base
        if "is longer than the model's context length" in str(e):
            metrics.refused("H1", role_of(tokenizer_manager), "over_context")
        elif "exceeds the model's maximum context length" in str(e):
            metrics.refused("H1", role_of(tokenizer_manager), "over_context_with_output")
        raise
