"""Canary probe of a live deployment through its load balancer: outputs, not status codes.

Tenants send prompts that end by asking the model to repeat a unique canary
string; no answer may contain another tenant's canary. A prompt over the
prefill KV pool must be refused (4xx): the incident's trigger was such a
prompt answered 200 over pages its transfer never wrote. And, as in the
sandbox's differential oracle, a greedy probe sent after each tenant's
traffic must give the same output whatever that tenant sent. A tenant's
prompt differs from the other's in every sentence, not only in its canary:
a probe that reads stale pages then reads different text after each tenant,
as it would after real customers. Request count and time are bounded; the
report is JSON.

A check that could not have failed on this deployment says so instead of
passing (``judged=False``): the canary check where no tenant's answer repeats
its own canary (a model that does not copy its prompt, such as the tests'
random-weight one, would not repeat another's either), and a probe's
independence where no probe got a 200 (nothing to compare). The report is
ok only if some check was judged and every judged check passed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..common.errors import HardenedError
from .filler import NO_ANSWER, Draft, WordCosts, counter, sized
from .oracle import Reply, Verdict, differential_check, generate

CANARY_HEX = 8  # hex digits of a canary: unique per run, and short enough for an answer to repeat
# checks that fail when the canary could not judge (exit 3, not 1): no token counts, no answer,
# or the probe cut short
SIZED = "prompts sized by the server's /tokenize"
ANSWERS = "the deployment answers"
FINISHED = "probe finished"
UNFINISHED = (SIZED, ANSWERS, FINISHED)
FITTING_PROBE = 64  # tokens of the probe that fits (or the tenants' length, if shorter)
PROGRESS_EVERY = 10  # requests between progress lines: a CronJob's log shows a slow probe moving


@dataclass(frozen=True)
class Plan:
    """How hard to probe: sizes come from preflight (the prefill pool and context length)."""

    pool_tokens: int
    context_length: int
    tenants: int = 2
    repeats: int = 4  # requests per tenant before each probe: enough to cycle decode's free pages
    rounds: int = 2
    max_new_tokens: int = 24  # room for an answer to repeat a canary (about a dozen tokens)
    max_requests: int = 80
    time_budget_s: float = 600.0
    request_timeout_s: float = 120.0

    def validate(self) -> None:
        if self.tenants < 2 or min(self.repeats, self.rounds, self.pool_tokens, self.context_length) < 1:
            raise HardenedError("canary needs at least 2 tenants, and positive repeats, rounds, pool and context")
        if self.requests_needed > self.max_requests:
            raise HardenedError(f"this plan sends {self.requests_needed} requests, over --max-requests "
                                f"{self.max_requests}: lower --repeats or --rounds, or raise the limit")

    @property
    def requests_needed(self) -> int:
        return 1 + 2 * self.rounds * self.tenants * (self.repeats + 1)  # one answered first, then two probes


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    judged: bool = True  # False: this deployment's answers could not have failed it (``detail`` says why)

    @property
    def result(self) -> str:
        return "n/a" if not self.judged else "ok" if self.ok else "FAIL"


@dataclass
class CanaryReport:
    url: str
    checks: list[Check] = field(default_factory=list)
    requests: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        judged = [c for c in self.checks if c.judged]
        return bool(judged) and all(c.ok for c in judged)

    @property
    def unjudged(self) -> bool:
        """Failed only because the deployment did not answer, or the probe did not finish."""
        return not self.ok and all(c.name in UNFINISHED for c in self.checks if c.judged and not c.ok)

    def to_json(self) -> dict:
        return {"url": self.url, "ok": self.ok, "unjudged": self.unjudged, "requests": self.requests, "seconds": round(self.seconds, 1),
                "checks": [{**asdict(c), "result": c.result} for c in self.checks]}


class _Sender:
    """Sends /generate requests within the plan's budget, remembering which tenant sent what,
    and says every PROGRESS_EVERY requests how far it is."""

    def __init__(self, url: str, plan: Plan, progress: Callable[[str], None]):
        self.url, self.plan, self.progress = url, plan, progress
        self.start = time.monotonic()
        self.deadline = time.monotonic() + plan.time_budget_s
        self.sent: list[tuple[str, Reply]] = []  # (prompt, reply)

    def __call__(self, prompt: str) -> Reply:
        if len(self.sent) >= self.plan.max_requests or time.monotonic() > self.deadline:
            raise HardenedError(f"canary budget spent ({len(self.sent)} requests, "
                                f"{self.plan.time_budget_s:g} s) before the probe finished")
        try:
            reply = generate(self.url, prompt, self.plan.max_new_tokens, self.plan.request_timeout_s)
        except NO_ANSWER as exc:  # no answer to judge
            raise HardenedError(f"{self.url}/generate did not answer: {getattr(exc, 'reason', exc)}") from None
        self.sent.append((prompt, reply))
        if len(self.sent) % PROGRESS_EVERY == 0:
            self.progress(f"canary: {len(self.sent)} of {self.plan.requests_needed} requests sent, "
                          f"{time.monotonic() - self.start:.0f} s of its {self.plan.time_budget_s:g} s")
        return reply


def _tenant_draft(tokens: int, tenant: str, canary: str) -> Draft:
    """The canary first, then filler of the tenant's own (drawn with the canary as seed, so every
    page a leak could expose differs between tenants) and a request to repeat it: a model that
    copies its prompt answers with the canary."""
    return Draft(tokens, canary, f"{tenant}'s secret is {canary}.", f". Repeat {tenant}'s secret: ")


def run_canary(url: str, plan: Plan, progress: Callable[[str], None] = lambda line: None,
               tokenize_url: str | None = None) -> CanaryReport:
    """Probe the deployment behind ``url`` (an LB) and judge it, saying how far it is through
    ``progress``; never raises on a finding. Every prompt is cut to its exact length by the
    ``/tokenize`` of the SGLang server at ``tokenize_url`` (default ``url``: a gateway that
    serves no ``/tokenize`` leaves the probe unjudged, naming it)."""
    plan.validate()
    start = time.monotonic()
    send = _Sender(url.rstrip("/"), plan, progress)
    report = CanaryReport(url)
    canaries = {f"tenant-{i}": f"CANARY-{uuid.uuid4().hex[:CANARY_HEX]}" for i in range(plan.tenants)}
    tenant_tokens = max(8, min(plan.pool_tokens, plan.context_length) * 7 // 10)
    # over the pool, and inside the context where the pool is the smaller (the incident's case)
    over_pool = plan.pool_tokens + max(16, (plan.context_length - plan.pool_tokens) // 2)
    count = counter(tokenize_url or url, plan.request_timeout_s)
    step = SIZED
    try:
        *tenants, over, fitting = sized(count, WordCosts.measure(count), [
            *(_tenant_draft(tenant_tokens, t, c) for t, c in canaries.items()),
            Draft(over_pool, "probe"), Draft(min(FITTING_PROBE, tenant_tokens), "probe")])
        step = ANSWERS
        _answers(send, fitting.text)
    except HardenedError as exc:  # no SGLang /tokenize there; the gate has closed the gateway
        report.checks.append(Check(step, False, str(exc)))
        report.requests, report.seconds = len(send.sent), time.monotonic() - start
        return report
    histories = {t: [p.text] * plan.repeats for t, p in zip(canaries, tenants)}
    try:
        verdicts = {name: differential_check(send, probe.text, histories, plan.rounds)
                    for name, probe in (("over-pool", over), ("fitting", fitting))}
    except HardenedError as exc:  # the budget spent, or the deployment stopped answering
        report.checks.append(Check(FINISHED, False, str(exc)))
        verdicts = {}
    report.checks.append(_cross_tenant(send.sent, canaries))
    if verdicts:
        replies = [r for rs in verdicts["over-pool"].replies.values() for r in rs]
        statuses = sorted({r.status for r in replies})
        report.checks.append(Check(f"over-pool prompt ({over.tokens} tokens) refused", all(400 <= s < 500 for s in statuses),
                                   f"HTTP {', '.join(map(str, statuses))} (must be 4xx)"))
        report.checks += [_independent(name, verdict) for name, verdict in verdicts.items()]
    report.requests, report.seconds = len(send.sent), time.monotonic() - start
    return report


def _answers(send: _Sender, prompt: str) -> None:
    """A prompt that fits must get a 200 before anything is judged: a gateway with no server
    behind it (503) would otherwise fail the over-pool check as if it had answered."""
    reply = send(prompt)
    if reply.status != 200:
        raise HardenedError(f"{send.url} answered a prompt that fits with HTTP {reply.status}: {reply.body[:300]}")


def _independent(name: str, verdict: Verdict) -> Check:
    """A probe's outputs must not differ with the tenant before it; judged only if one got a 200."""
    outputs = {label: [o and list(o) for o in verdict.outputs(label)] for label in verdict.replies}
    answered = any(o is not None for label in verdict.replies for o in verdict.outputs(label))
    return Check(f"{name} probe independent of the previous tenant", not verdict.leaked,
                 json.dumps(outputs)[:300] if answered else "every probe was refused: no output to compare",
                 judged=answered)


def _cross_tenant(sent: list[tuple[str, Reply]], canaries: dict[str, str]) -> Check:
    """An answer may hold only the canary of the prompt it answers (probes carry none). Judged
    only where some tenant's answer repeats its own canary: a model that does not copy from its
    prompt could not repeat another's either, so silence would prove nothing."""
    leaks, echoed = [], 0
    for prompt, reply in sent:
        asker = next((t for t, c in canaries.items() if c in prompt), "a probe")
        echoed += asker != "a probe" and canaries[asker] in reply.body
        leaks += [f"{asker}'s answer holds {t}'s canary" for t, c in canaries.items() if t != asker and c in reply.body]
    name = "no tenant sees another's canary"
    if not leaks and not echoed:
        return Check(name, True, f"no answer of {len(sent)} repeats its own tenant's canary: "
                                 "this model does not copy its prompt, so this check cannot fail here", judged=False)
    return Check(name, not leaks, "; ".join(leaks[:5]) or f"{len(sent)} answers read, {echoed} repeat their own canary")
