"""The model's state: immutable, canonical tuples, so states hash and dedupe.

Every field is a plain tuple, bool, int or str (NamedTuple), so two states
that mean the same thing compare equal and the search can store them in a
set. Phase names are short strings rather than Enum members because Enum
hashing runs Python code and the search hashes every state it meets.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

Pages = tuple[int, ...]

#: Writer id of a page that still holds KV from earlier traffic of another
#: tenant (decode never zeroes pages; the model starts from a warm pool).
PRIOR = -1

# Prefill-side phases of a request.
P_NEW = "new"  # not yet through Scheduler.handle_generate_request
P_BOOT = "boot"  # in PrefillBootstrapQueue, waiting for decode's page indices
P_XFER = "xfer"  # forward done, KV chunks being sent
P_OK = "ok"  # KVPoll.Success reported: prefill answers 200
P_FAILED = "failed"  # error surfaced to the client
P_REJECTED = "rejected"  # refused at admission (is_unadmitted_reject)
P_LOST = "lost"  # prefill process crashed under it
P_DONE = frozenset({P_OK, P_FAILED, P_REJECTED, P_LOST})

# Decode-side phases of a request.
D_NEW = "new"  # not yet at decode
D_PREALLOC = "prealloc"  # in DecodePreallocQueue, waiting for free pages
D_WAIT = "wait"  # pages allocated, indices sent, in DecodeTransferQueue
D_RUN = "run"  # transfer committed, decode steps read the pages
D_OK = "ok"  # finished: decode answers 200
D_HELD = "held"  # aborted; pages held by deferred release until ack/timeout
D_FAILED = "failed"  # ended with an error, pages freed
D_LOST = "lost"  # decode process crashed under it
D_DONE = frozenset({D_OK, D_FAILED, D_LOST})

# What decode's KV receiver has been told about the transfer.
ST_NONE = ""
ST_SUCCESS = "success"
ST_NO_METADATA = "success-no-metadata"  # Success, but the metadata row never lands (H13)
ST_FAILED = "failed"


class Kind(Enum):
    """How prefill's intake treats the prompt."""

    FITS = "fits"  # fits both pools; prefill sends every page
    OVER = "over-pool"  # longer than prefill's pool: validate_input_length fails
    TRUNC = "truncated"  # --allow-auto-truncate: prefill silently sends fewer pages


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload, from its own tenant.

    ``decode_pages`` is what decode preallocates for the full prompt;
    ``sent_pages`` is what prefill writes (one page per chunk): the single
    placeholder page for an over-pool prompt, fewer pages when truncated.
    """

    kind: Kind
    decode_pages: int
    sent_pages: int


@dataclass(frozen=True)
class Scenario:
    """A bounded workload: the search is exhaustive within these bounds."""

    name: str
    requests: tuple[RequestSpec, ...]
    pool_pages: int
    faults: int
    #: Tensor-parallel ranks per role, equal on both sides: prefill rank k writes decode rank
    #: k's shard of every page over its own transfer lane, and each role's ranks run one
    #: scheduler in step (same admissions, same page indices) as long as they agree.
    ranks: int = 1
    #: Whether a write may be reported done and never land (the ``batch_skip`` fault). Drawn
    #: where H8 and its rank agreement need it (the over-pool workloads), not everywhere: it
    #: adds 40% to a scenario's states, and CI checks every scenario many times over.
    skips: bool = False

    def tenant(self, r: int) -> str:
        """Tenant letter of request ``r`` (each request its own tenant)."""
        return "tenant " + "ABCDEFGH"[r]


class Req(NamedTuple):
    """Both halves of one request: prefill's and decode's view."""

    p: str = P_NEW
    tofinish: bool = False  # intake error parked in req.to_finish (not finished)
    p_abort: bool = False  # an abort for this room is pending at prefill
    sent: tuple[int, ...] = (0,)  # per prefill rank: chunks whose synchronous batch returned ok
    dst: Pages = ()  # decode's page indices, as prefill received them
    d: str = D_NEW
    d_abort: bool = False  # a client abort is pending at decode
    status: str = ST_NONE  # what decode's ranks poll, all-reduced (MIN: any Failed fails all)
    alloc: Pages = ()  # pages decode allocated to this request


class Batch(NamedTuple):
    """The synchronous batch_transfer_sync call in flight on one rank's lane.

    ``landed`` is set once its write has reached decode's pages (that rank's
    shard of them); until the call returns, that rank's transfer worker
    cannot do anything else.
    """

    req: int
    chunk: int
    landed: bool


class State(NamedTuple):
    """One global state of prefill, decode and the transfer lanes."""

    reqs: tuple[Req, ...]
    pages: tuple[tuple[int, ...], ...]  # per rank: last completed writer of each decode page
    free: Pages  # decode's free list: allocate from the front, free to the back
    lanes: tuple[Batch | None, ...]  # per rank: the batch in flight on its transfer lane
    faults: int  # faults (disconnect, transport error, crash) still allowed
    crashed: bool  # a node crashed in this run (long timeouts become expected)
    #: What decode's ranks disagreed on, once one acted alone; their next collective never
    #: matches, so nothing follows (upstream: "releasing only on some ranks would diverge
    #: admission and the sizes of subsequent polling collectives").
    diverged: str = ""

    def busy(self, r: int) -> bool:
        """A batch of request ``r`` is in flight on some rank's lane."""
        return any(b is not None and b.req == r for b in self.lanes)


def initial_state(scenario: Scenario) -> State:
    """A warm pool: every page holds an earlier tenant's KV, none owned."""
    n, ranks = scenario.pool_pages, scenario.ranks
    return State(
        reqs=tuple(Req(sent=(0,) * ranks) for _ in scenario.requests),
        pages=((PRIOR,) * n,) * ranks,
        free=tuple(range(n)),
        lanes=(None,) * ranks,
        faults=scenario.faults,
        crashed=False,
    )
