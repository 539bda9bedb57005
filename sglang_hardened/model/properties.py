"""What must hold: three safety predicates over single states, and the
goals the liveness checks ask every state to be able to reach.

Safety is checked on states, not steps, so a violation is caught however
the search first reaches the state:

- ``foreign-read``: decode is decoding a request over a page that its own
  transfer never wrote and that holds another tenant's KV (the incident);
- ``overwritten-read``: decode reads a page its transfer sent that holds
  another request's KV: a later write overwrote it, or the write was
  reported done but never landed (``batch_skip``);
- ``reuse-under-write``: a page is allocated to one request while a write
  of another may still land in it (a batch in flight, or chunks a live
  sender will still send to its old page indices);
- ``over-pool-success``: a request over prefill's pool gets a success from
  prefill (KVPoll.Success, HTTP 200) or from decode (finished, HTTP 200);
- ``ranks-diverge``: with more than one rank, one decode rank frees, refuses
  or decodes what another does not (their schedulers leave lock-step: the
  next collective never matches and the server answers no one again).

With more than one rank the reads are judged on every rank's shard of a
page: a page is decode's to read only if each rank's last write is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .state import (
    D_DONE,
    D_HELD,
    D_OK,
    D_RUN,
    P_DONE,
    P_OK,
    P_XFER,
    PRIOR,
    Kind,
    Scenario,
    State,
)

SAFETY = (
    "foreign-read",
    "overwritten-read",
    "reuse-under-write",
    "over-pool-success",
    "ranks-diverge",
)


class Violation(NamedTuple):
    """A broken property and what broke it, in words."""

    kind: str
    message: str


def writer_name(scenario: Scenario, w: int) -> str:
    """Who made a page's last completed write."""
    return "an earlier tenant" if w == PRIOR else f"r{w} ({scenario.tenant(w)})"


def pending_writes(s: State, scenario: Scenario) -> dict[int, int]:
    """Pages a write may still land in (on any rank), and whose write it would be."""
    out: dict[int, int] = {}
    for r, q in enumerate(s.reqs):
        if q.p == P_XFER and not q.p_abort:
            for k, b in enumerate(s.lanes):
                first = q.sent[k] + (1 if b is not None and b.req == r and b.landed else 0)
                for page in q.dst[first : scenario.requests[r].sent_pages]:
                    out[page] = r
    for b in s.lanes:
        if b is not None and not b.landed:
            out[s.reqs[b.req].dst[b.chunk]] = b.req
    return out


def safety_violations(s: State, scenario: Scenario) -> list[Violation]:
    """Every safety property ``s`` breaks (usually none)."""
    found: list[Violation] = []
    for r, q in enumerate(s.reqs):
        spec = scenario.requests[r]
        who = f"r{r} ({scenario.tenant(r)}, {spec.kind.value})"
        if q.d == D_RUN:
            for k, pages in enumerate(s.pages):
                at = f" on rank {k}" if len(s.pages) > 1 else ""
                for i, page in enumerate(q.alloc):
                    w = pages[page]
                    if w == r:
                        continue
                    if i < spec.sent_pages:
                        found.append(
                            Violation(
                                "overwritten-read",
                                f"{who} decodes page {page}{at}, which its transfer sent but "
                                f"which holds the KV of {writer_name(scenario, w)} (overwritten "
                                "afterwards, or a write reported done that never landed)",
                            )
                        )
                    else:
                        found.append(
                            Violation(
                                "foreign-read",
                                f"{who} decodes page {page}{at}, which its transfer never wrote "
                                f"({spec.sent_pages} of {len(q.alloc)} pages sent) and which "
                                f"holds the KV of {writer_name(scenario, w)}",
                            )
                        )
        if spec.kind is Kind.OVER and (q.p == P_OK or q.d == D_OK):
            role = "prefill" if q.p == P_OK else "decode"
            found.append(
                Violation(
                    "over-pool-success",
                    f"{who} is over prefill's pool but {role} answers 200",
                )
            )
    if s.diverged:
        found.append(Violation("ranks-diverge", s.diverged))
    pending = pending_writes(s, scenario)
    if pending:
        for r, q in enumerate(s.reqs):
            for page in q.alloc:
                writer = pending.get(page)
                if writer is not None and writer != r:
                    found.append(
                        Violation(
                            "reuse-under-write",
                            f"page {page} is allocated to r{r} ({scenario.tenant(r)}) while a write "
                            f"of r{writer} ({scenario.tenant(writer)}) into it may still land",
                        )
                    )
    return found


def all_ended(s: State) -> bool:
    """Liveness goal: both halves of every request have ended."""
    return all(q.p in P_DONE and q.d in D_DONE for q in s.reqs)


def no_hold(r: int) -> Callable[[State], bool]:
    """Liveness goal for request ``r``: decode no longer holds its pages
    for a deferred release (acknowledged or timed out)."""

    def goal(s: State) -> bool:
        return s.reqs[r].d != D_HELD

    return goal
