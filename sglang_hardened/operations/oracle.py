"""Differential leak oracle: a request's greedy output must not depend on history.

KV pages are never zeroed, so a request that decodes over pages its own
transfer did not write reads whatever an earlier tenant left there, behind an
HTTP 200. Status codes cannot show that; outputs can. With greedy decoding a
correct server maps a prompt to one output whatever ran before it, so running
the same probe after different histories and comparing outputs is a sound
check that needs no knowledge of the model. Used by the tests and the canary.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Reply:
    """One /generate answer: status (None: none came), output token ids (on 200), raw body, latency."""

    status: int | None
    output_ids: tuple[int, ...] | None
    body: str
    seconds: float


def generate(base_url: str, text: str, max_new_tokens: int = 8, timeout: float = 600.0,
             extra: Mapping[str, object] | None = None) -> Reply:
    """POST a greedy /generate request; never raises on an HTTP error status, ValueError on a 200
    that holds no output ids."""
    payload = {"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
               **(extra or {})}
    req = urllib.request.Request(f"{base_url.rstrip('/')}/generate", data=json.dumps(payload).encode(),
                                 headers={"content-type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode(errors="replace")
    seconds = time.monotonic() - start
    return Reply(status, _output_ids(body) if status == 200 else None, body, seconds)


def _output_ids(body: str) -> tuple[int, ...]:
    """A 200's output token ids; ValueError naming the body where it is not SGLang's answer (a
    proxy's page)."""
    try:
        return tuple(json.loads(body)["output_ids"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"HTTP 200 without output_ids (not an SGLang answer): {body[:300]}") from None


@dataclass
class Verdict:
    """Probe replies per history label, in run order; ``leaked`` if outputs differ."""

    replies: dict[str, list[Reply]] = field(default_factory=dict)

    def outputs(self, label: str) -> list[tuple[int, ...] | None]:
        return [r.output_ids for r in self.replies[label]]

    @property
    def leaked(self) -> bool:
        return len({o for label in self.replies for o in self.outputs(label)}) > 1


def differential_check(send: Callable[[str], Reply], probe: str,
                       histories: Mapping[str, Sequence[str]], rounds: int = 1) -> Verdict:
    """Run each history then ``probe``, ``rounds`` times round-robin; compare probe outputs.

    A history is the list of prompts other tenants send first (repeat a prompt
    to cycle the server's free pages through it).
    """
    return differential_checks(send, {"probe": probe}, histories, rounds)["probe"]


def differential_checks(send: Callable[[str], Reply], probes: Mapping[str, str],
                        histories: Mapping[str, Sequence[str]], rounds: int = 1) -> dict[str, Verdict]:
    """``differential_check`` for several probes, sent in turn after each history: the
    probes before a probe are the same after every history, so only the history differs."""
    verdicts = {name: Verdict({label: [] for label in histories}) for name in probes}
    for _ in range(rounds):
        for label, prompts in histories.items():
            for p in prompts:
                send(p)
            for name, probe in probes.items():
                verdicts[name].replies[label].append(send(probe))
    return verdicts
