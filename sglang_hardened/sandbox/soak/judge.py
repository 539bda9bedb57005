"""One request's verdict, against the quiet cluster's answer to the same prompt.

A request ends well with a 200 whose every sequence is the quiet answer, or with an
error whose body names a cause (a fault may fail any request; it may not make one lie).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .catalogue import Catalogue
from .plan import Step
from .traffic import Sent, prompts_of

# Outcomes that are fine, and the violations, each with what it means.
OUTCOMES = {
    "ok": "200, the quiet cluster's output",
    "refused": "an error the quiet cluster gives too",
    "failed": "an error where the quiet cluster answers, named, or any while a server fault was in effect",
    "hung-up": "the client hung up (judged by the pages only)",
}
VIOLATIONS = {
    "wrong-output": "a 200 whose output differs from the quiet cluster's for the same prompt",
    "answered-over-limit": "a 200 for a prompt over the prefill pool or the input limit (the incident's shape)",
    "hang": "no answer within the bound",
    "broken-answer": "the connection broke, or a stream ended without [DONE] or an error, with no server fault in effect",
    "unnamed-error": "an error status whose body names no cause, with no server fault in effect",
    "bad-input-5xx": "a malformed request answered 5xx with no server fault in effect",
    "page-freed-under-write": "decode freed a page while a write into it could still land",
    "source-freed-under-write": "prefill freed a page while a write was reading it",
    "pages-not-idle": "KV pages still held once the soak settled",
    "server-down": "a server did not answer once the soak settled (it died, or never came back)",
    "process-leaked": "a process of a killed server still alive",
}
GENERIC = {"", "internal server error", "bad gateway", "service unavailable", "gateway timeout"}
MESSAGE_KEYS = ("message", "detail", "msg", "error")  # where SGLang, FastAPI and the routers put a cause


@dataclass(frozen=True)
class Outcome:
    step: Step
    status: int | None
    seconds: float
    verdict: str  # a key of OUTCOMES or VIOLATIONS
    detail: str

    @property
    def violation(self) -> bool:
        return self.verdict in VIOLATIONS


def names_a_cause(body: str) -> bool:
    """An error body that says something beyond its status line: a message, not the fixed
    fields around one (``"type": "invalid_request_error"``, ``"object": "error"``)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip().lower() not in GENERIC
    messages = []

    def walk(x) -> None:
        if isinstance(x, dict):
            for key, value in x.items():
                if key in MESSAGE_KEYS and isinstance(value, str):
                    messages.append(value)
                else:
                    walk(value)
        elif isinstance(x, list):
            for value in x:
                walk(value)

    walk(data)
    return any(m.strip().lower() not in GENERIC for m in messages)


def judge(step: Step, sent: Sent, cat: Catalogue, bound_s: float, calm_at: float | None = None) -> Outcome:
    """``calm_at``: when the last server fault in effect while the request ran ended (None: none
    was). The bound runs from the later of the send and that moment."""
    def out(verdict: str, detail: str = "") -> Outcome:
        return Outcome(step, sent.status, sent.seconds, verdict, detail)

    disturbed = calm_at is not None
    waited = sent.sent_at + sent.seconds - max(sent.sent_at, calm_at or sent.sent_at)
    if sent.hung_up:
        return out("hung-up")
    if waited > bound_s:
        return out("hang", f"{sent.body[:200]} after {sent.seconds:.1f} s, {waited:.1f} s after the last server fault "
                           f"in its way ended (bound {bound_s:.0f} s)")
    if sent.status is None:
        return out("failed" if disturbed else "broken-answer", f"{sent.body[:200]} after {sent.seconds:.1f} s")
    if step.kind == "malformed":
        if sent.status == 200:
            return out("wrong-output", f"a malformed request answered 200: {sent.body[:200]}")
        if sent.status >= 500 and not disturbed:
            return out("bad-input-5xx", f"HTTP {sent.status}: {sent.body[:200]}")
        named = names_a_cause(sent.body)
        return out("refused" if named else "failed" if disturbed else "unnamed-error", f"HTTP {sent.status}: {sent.body[:200]}")
    expected = [cat.expected[p.text] for p in prompts_of(step, cat)]
    if sent.status != 200:
        if not names_a_cause(sent.body):
            return out("failed" if disturbed else "unnamed-error", f"HTTP {sent.status}: {sent.body[:200]!r}")
        quiet = {e.status for e in expected}
        return out("refused" if quiet == {sent.status} else "failed", f"HTTP {sent.status}: {sent.body[:200]}")
    if step.kind in ("over-pool", "over-limit"):
        return out("answered-over-limit", f"{prompts_of(step, cat)[0].tokens}-token prompt answered 200")
    want = tuple(e.output_ids for e in expected for _ in range(2 if step.kind == "n2" else 1))
    if sent.outputs != want:
        return out("wrong-output", f"got {sent.outputs}, the quiet cluster {want}")
    return out("ok")
