"""What a soak sends and injects: request kinds and faults with their shares, drawn per
request from the seed, so one seed gives the same schedule on every build it is run on.
A server fault names its server by a number drawn with it (the injector takes it modulo the
role's servers), so the schedule does not depend on the cluster's shape."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..env import SandboxError

# Each fault with what it does; a rate is the share of requests that carry it (0..1, summing to 1 at most).
FAULTS = {
    "disconnect": "the client hangs up at a random moment",
    "abort-prefill": "POST /abort_request for the request to its prefill (sent to every prefill: one has it)",
    "abort-decode": "POST /abort_request for the request to its decode (likewise)",
    "stop-prefill": "SIGSTOP one prefill for a time below or above the release timeout, then SIGCONT",
    "stop-decode": "SIGSTOP one decode for a time below or above the release timeout, then SIGCONT",
    "kill-prefill": "SIGKILL one prefill, then restart it with the same arguments",
    "kill-decode": "SIGKILL one decode, then restart it with the same arguments",
    "fail-part-way": "for a few seconds, each transfer one prefill sends writes half its pages and then fails",
    "rolling-restart": "every server in turn, prefills first: SIGTERM, restarted, healthy before the next",
}
SERVER_FAULTS = ("stop-prefill", "stop-decode", "kill-prefill", "kill-decode", "fail-part-way",
                 "rolling-restart")  # one at a time
DEFAULT_RATES = {"disconnect": 0.04, "abort-prefill": 0.02, "abort-decode": 0.02, "stop-prefill": 0.02,
                 "stop-decode": 0.02, "kill-prefill": 0.005, "kill-decode": 0.005, "fail-part-way": 0.02,
                 "rolling-restart": 0.0005}  # a roll restarts every server: a few per half hour

KINDS = {
    "fits": "a prompt that fits, lengths across page and chunk boundaries",
    "stream": "the same, streamed",
    "n2": "the same with n=2 (parallel sampling)",
    "batch": "two fitting prompts in one request",
    "over-pool": "a prompt over the prefill KV pool",
    "over-limit": "a prompt over the input limit (the context length)",
    "malformed": "a request the servers must refuse with a 4xx",
}
SINGLE = ("fits", "stream", "over-pool", "over-limit")  # one rid: what an abort can name
DEFAULT_MIX = {"fits": 0.5, "stream": 0.15, "n2": 0.05, "batch": 0.1, "over-pool": 0.08, "over-limit": 0.06,
               "malformed": 0.06}

FAULT_AFTER_S = (0.0, 2.0)  # a fault lands this long after its request is sent (uniform)
STOP_BELOW = (0.2, 0.6)  # a stop's length in release timeouts, below ...
STOP_ABOVE = (1.3, 2.0)  # ... or above it, one or the other with even odds


@dataclass(frozen=True)
class Step:
    """One request of one client: its kind, which prompt of the catalogue, and its fault."""

    client: int
    index: int
    kind: str
    prompt: int  # an index into the catalogue's prompts for the kind (taken modulo their count)
    fault: str | None
    fault_after_s: float
    stop_s: float  # a stop fault's length
    variant: int  # which malformed body, which second prompt of a batch
    target: int = 0  # which server of its role a server fault hits (taken modulo their count)


@dataclass(frozen=True)
class SoakPlan:
    """How long, how many clients, and what share of requests carry each kind and fault."""

    release_timeout_s: float  # decode's deferred-release timeout: what a stop is measured in
    seed: int = 0
    clients: int = 8
    duration_s: float = 300.0
    rates: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_RATES))
    mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    answer_bound_s: float = 10.0  # beyond the longest timeout in a request's way, what a client may wait
    waiting_timeout_s: float = 0.0  # decode's waiting/bootstrap timeout, where it bounds a handshake (0: not)

    def validate(self) -> None:
        if unknown := sorted(set(self.rates) - set(FAULTS)):
            raise SandboxError(f"unknown fault {', '.join(unknown)}: choose from {', '.join(FAULTS)}")
        if unknown := sorted(set(self.mix) - set(KINDS)):
            raise SandboxError(f"unknown request kind {', '.join(unknown)}: choose from {', '.join(KINDS)}")
        if bad := [f"{n}={r:g}" for n, r in self.rates.items() if not 0.0 <= r <= 1.0]:
            raise SandboxError(f"fault rates are shares of requests, 0..1: {', '.join(bad)}")
        if sum(self.rates.values()) > 1.0:
            raise SandboxError(f"fault rates sum to {sum(self.rates.values()):g}: each request carries one fault at most")
        if any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise SandboxError("the request mix needs non-negative weights with a positive sum")
        if self.clients < 1 or self.duration_s <= 0 or self.release_timeout_s <= 0:
            raise SandboxError("a soak needs at least one client, and a positive duration and release timeout")

    @property
    def bound_s(self) -> float:
        """The longest a client may wait for an answer: a stop above the release timeout then the
        timeout, or a handshake with a restarted prefill failing at decode's waiting timeout."""
        return max(self.release_timeout_s * (1 + STOP_ABOVE[1]), self.waiting_timeout_s) + self.answer_bound_s

    def step(self, client: int, index: int) -> Step:
        """The ``index``-th request of ``client``: a function of the seed alone."""
        rng = random.Random(f"{self.seed}/{client}/{index}")
        fault, cumulative, u = None, 0.0, rng.random()
        for name, rate in self.rates.items():
            cumulative += rate
            if u < cumulative:
                fault = name
                break
        kinds = {k: w for k, w in self.mix.items() if w > 0 and _can_carry(k, fault)}
        kinds = kinds or {"fits": 1.0}  # a fault that needs a rid where the mix has no single-rid kind
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        stop = STOP_ABOVE if rng.random() < 0.5 else STOP_BELOW
        return Step(client, index, kind, rng.randrange(1 << 16), fault, rng.uniform(*FAULT_AFTER_S),
                    rng.uniform(*stop) * self.release_timeout_s, rng.randrange(1 << 16), rng.randrange(1 << 16))


def _can_carry(kind: str, fault: str | None) -> bool:
    """A malformed request reaches no transfer to fault; an abort names one rid."""
    if fault is None:
        return True
    return kind != "malformed" and (not fault.startswith("abort-") or kind in SINGLE)
