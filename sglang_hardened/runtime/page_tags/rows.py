"""H8: every KV page decode reads must carry the tag of the request reading it.

Each side keeps a small tag buffer beside its KV pool: one row per page, two
int64 words (bootstrap room, epoch) per KV head of the rank (one slot per head:
between unequal TP sizes each prefill rank writes only its heads' slice of a
decode page, and stamps only those heads' slots). Decode picks a fresh epoch every time it
allocates pages for a request and sends it to prefill with the page indices.
Prefill writes (room, epoch) into its own rows for the pages it sends, and the
transfer engine moves those rows like one more KV "layer" (item = one row), so
a row reaches decode exactly when, and where, that page's KV does. Before the
request's first decode step, decode compares the rows of the pages in its page
table with (room, epoch): a page nobody wrote, a page written by another
request or by an earlier allocation of the same room (abort, retraction), or a
page given away early, fails.

No stamp means failure: allocation and release reset rows to UNSTAMPED, which
no request carries (rooms are non-negative; epochs start at 1). Decode never
stamps its own rows: only data that travelled can vouch for itself.

The check is O(pages) integer work in one vectorised compare, on the KV
pool's device. Two implementations of the row operations share the rows'
memory and one test suite: torch ops on a GPU (what
`benchmarks/gpu_page_tags.py` measures), numpy views on CPU, where each torch
call's fixed dispatch cost is most of the work (docs/page-tags.md). On the
torch path the check's count is copied to host memory behind an event
(`PendingCount`), so decode's loop reads its verdict once the device has
written it rather than waiting for the device (docs/performance.md).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ...common.knobs import PAGE_TAGS_FAIL_CLOSED
from .. import metrics
from .cost import CostMeter

# Rows a request can never match: rooms are >= 0 and epochs start at 1.
UNSTAMPED = -1
TAG_WORDS = 2  # room, epoch

log = logging.getLogger("sglang_hardened")

Pages = torch.Tensor | np.ndarray | Sequence[int]
Index = torch.Tensor | np.ndarray  # page indices in the form one row path takes


class TorchRows:
    """The row operations as torch ops on the rows' device: what CUDA runs (no host round trip
    but the check's one sync)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        # Made once, not per call: slicing the (room, epoch) columns per stamp would cost an op each.
        self._rooms, self._epochs = rows[:, 0::TAG_WORDS], rows[:, 1::TAG_WORDS]

    def index(self, pages: Pages) -> torch.Tensor:
        """Page indices as an int64 tensor on the rows' device (no copy if already one):
        `index_fill_` takes nothing narrower."""
        return torch.as_tensor(pages, dtype=torch.int64, device=self.rows.device)

    def gather_index(self, pages: Pages) -> torch.Tensor:
        """Page indices for `index_select`, which takes SGLang's int32 page tables as they are:
        a tensor already fit is not touched (a conversion is one more torch call per request)."""
        if isinstance(pages, torch.Tensor) and pages.dtype in (torch.int32, torch.int64) \
                and pages.device == self.rows.device:
            return pages
        return self.index(pages)

    def fill(self, idx: torch.Tensor, room: int, epoch: int) -> None:
        """Stamp the rows."""
        # Two scalar fills, not one index_put_ of a (room, epoch) row: the row would be a host
        # tensor per call (an H2D copy that syncs on CUDA).
        self._rooms.index_fill_(0, idx, room)
        self._epochs.index_fill_(0, idx, epoch)

    def clear(self, idx: torch.Tensor) -> None:
        """Reset the rows to UNSTAMPED."""
        self.rows.index_fill_(0, idx, UNSTAMPED)

    def matching(self, idx: torch.Tensor, room: int, epoch: int) -> torch.Tensor:
        """Per page among `idx`, whether every slot holds (room, epoch), left on the device: a
        gather and two compares with scalars (a row of (room, epoch) made on the host would be a
        host-to-device copy, which waits for the stream on CUDA)."""
        got = self.rows.index_select(0, idx)
        return got[:, 0::TAG_WORDS].eq(room).logical_and_(got[:, 1::TAG_WORDS].eq(epoch)).all(dim=1)

    def count_matching(self, idx: torch.Tensor, room: int, epoch: int) -> torch.Tensor:
        """How many pages among `idx` match, as a 0-d int64 tensor left on the device: what
        `PendingCount` copies to the host (one word, whatever the verdict)."""
        return self.matching(idx, room, epoch).sum()


class NumpyRows:
    """The same operations on a numpy view of CPU rows: a numpy call costs less than a torch
    call's dispatch, which was most of the work, and SGLang hands CPU page indices over as
    numpy arrays already."""

    def __init__(self, rows: torch.Tensor) -> None:
        self._view = rows.numpy()  # the same memory: what the transfer engine reads and writes

    def index(self, pages: Pages) -> np.ndarray:
        """Page indices as a numpy index array; a negative one raises, as torch's gather does
        (numpy would wrap it round to another page)."""
        idx = np.asarray(pages.numpy(force=True) if isinstance(pages, torch.Tensor) else pages, dtype=np.intp)
        if len(idx) and idx.min() < 0:
            raise IndexError(f"page index {int(idx.min())} is out of range for {len(self._view)} tag rows")
        return idx

    gather_index = index

    def fill(self, idx: np.ndarray, room: int, epoch: int) -> None:
        """Stamp the rows. Two scalar column writes: in the servers they cost less than one
        16-byte item per row (np.put on a void view), faster only with warm caches."""
        self._view[idx, 0::TAG_WORDS] = room
        self._view[idx, 1::TAG_WORDS] = epoch

    def clear(self, idx: np.ndarray) -> None:
        """Reset the rows to UNSTAMPED."""
        self._view[idx] = UNSTAMPED

    def bad_pages(self, idx: np.ndarray, room: int, epoch: int) -> int:
        """Pages among `idx` with a slot that is not (room, epoch): a gather and one compare;
        only a refusal pays for counting."""
        got = np.take(self._view, idx, axis=0)
        expect = np.array([room, epoch] * (self._view.shape[1] // TAG_WORDS), dtype=np.int64)
        if (got == expect).all():
            return 0
        return int(np.count_nonzero((got != expect).any(axis=1)))


ROW_PATHS: dict[str, type[TorchRows] | type[NumpyRows]] = {"torch": TorchRows, "numpy": NumpyRows}


def row_path(device: torch.device, path: str | None) -> str:
    """numpy on CPU, torch elsewhere, unless a test or benchmark names one (numpy only on CPU)."""
    chosen = path or ("numpy" if device.type == "cpu" else "torch")
    if chosen not in ROW_PATHS or (chosen == "numpy" and device.type != "cpu"):
        raise ValueError(f"page tag path {chosen!r} cannot run on {device}: torch anywhere, numpy on CPU")
    return chosen


class Counted:
    """A check's count of bad pages, on the host at once (the numpy path: numpy reads the rows
    where they are)."""

    def __init__(self, pages: int, bad: int) -> None:
        self.pages, self._bad = pages, bad

    def ready(self) -> bool:
        return True

    def bad(self) -> int:
        return self._bad


Slot = tuple[torch.Tensor, np.ndarray]  # one int64: the device copy's target, and its host view


class HostSlots:
    """Host memory the torch path's counts are copied to, one int64 per check in flight: pinned
    on CUDA, so the copy is queued on the stream and the host does not wait for it, and read
    through a numpy view, a read of host memory that involves neither torch nor the device. A
    slot given back before its copy has landed is reused only once its event has completed: a
    reused slot must not be overwritten by an earlier check's late copy."""

    GROW = 64  # slots made at a time: made with the buffer, so the loop rarely makes any

    def __init__(self, device: torch.device) -> None:
        self._pinned = device.type == "cuda"
        self._free: list[Slot] = []
        self._landing: list[tuple[Slot, object]] = []  # given back with their copy's event
        self._grow()

    def _grow(self) -> None:
        slab = torch.empty(self.GROW, dtype=torch.int64, pin_memory=self._pinned)
        host = slab.numpy()  # the same memory
        self._free.extend((slab[i], host[i:i + 1]) for i in range(self.GROW))

    def take(self) -> Slot:
        if not self._free:
            landing, self._landing = self._landing, []
            for slot, event in landing:
                if event.query():
                    self._free.append(slot)
                else:
                    self._landing.append((slot, event))
        if not self._free:
            self._grow()
        return self._free.pop()

    def give(self, slot: Slot, event) -> None:
        self._landing.append((slot, event))


class PendingCount:
    """The torch path's count, on its way to the host: the matching pages' count (a 0-d tensor
    on the rows' device) copied without blocking to a host slot, and an event recorded behind
    the copy on the current stream. `ready` asks the event (no wait); `bad` reads the slot,
    waiting for the event only if asked before it completed (`DecodePageTags.check`, and tests).
    The slot goes back when the count is read or dropped unread (a request released first)."""

    def __init__(self, slots: HostSlots, pages: int, matching: torch.Tensor, event: Callable[[], object]) -> None:
        self.pages, self._bad = pages, None
        self._slot = slot = slots.take()
        slot[0].copy_(matching, non_blocking=True)
        self._event = event()
        self._event.record()
        self._give_back = weakref.finalize(self, slots.give, slot, self._event)

    def ready(self) -> bool:
        return self._bad is not None or self._event.query()

    def bad(self) -> int:
        if self._bad is None:
            if not self._event.query():
                self._event.synchronize()  # only where both halves run at once (`check`)
            self._bad = self.pages - int(self._slot[1][0])
            self._give_back()
        return self._bad


class TagBuffer:
    """One pool's tag rows: a (pages, 2 x heads) int64 tensor on the pool's device, a
    (room, epoch) slot per KV head of the rank.

    Registered with the transfer engine as one more buffer; `buf_info` has the
    (ptr, nbytes, item_len) triple that SGLang's KV registration takes.
    """

    def __init__(self, num_pages: int, device: torch.device | str = "cpu", cost: CostMeter | None = None,
                 path: str | None = None, heads: int = 1) -> None:
        self._adopt(torch.full((num_pages, TAG_WORDS * heads), UNSTAMPED, dtype=torch.int64, device=device),
                    cost, path)

    @classmethod
    def over(cls, rows: torch.Tensor, cost: CostMeter | None = None, path: str | None = None) -> TagBuffer:
        """A buffer on rows it does not own: one lane of a `SourceTags` registration."""
        buffer = cls.__new__(cls)
        buffer._adopt(rows, cost, path)
        return buffer

    def _adopt(self, rows: torch.Tensor, cost: CostMeter | None, path: str | None) -> None:
        self.cost = cost  # prefill's: each stamp is timed
        self.rows = rows
        self.device: torch.device = self.rows.device
        self.path = row_path(self.device, path)
        self.ops = ROW_PATHS[self.path](self.rows)

    def buf_info(self) -> tuple[int, int, int]:
        """(data_ptr, nbytes, item_len): item_len is one page's row (every head's slot), as KV
        item_len is one page."""
        return self.rows.data_ptr(), self.rows.nbytes, self.rows[0].nbytes

    def stamp(self, pages: Pages, room: int, epoch: int) -> None:
        """Prefill: write (room, epoch) into every slot of the rows of the pages about to be sent."""
        start = self.cost.start() if self.cost is not None else None
        idx = self.ops.index(pages)
        self.ops.fill(idx, room, epoch)
        if self.cost is not None:
            self.cost.add("stamp", start, 1, len(idx))

    def clear(self, pages: Pages) -> None:
        """Reset rows to UNSTAMPED: whatever the page held no longer vouches for anyone."""
        self.ops.clear(self.ops.index(pages))


class SourceTags:
    """Prefill's tag rows: one set of rows (a lane) per transfer worker thread, registered as one
    buffer.

    Two requests whose prompts share cached prefix pages send the same prefill pages. With one
    set of rows, a worker sending to one decode could restamp those rows while another worker's
    write to another decode still reads them, and a correct request would be refused (with
    fail-closed on, decode would stop). A worker stamps and sends only its own lane's rows, and
    within a lane a stamp never overtakes a write that reads it (Mooncake's send returns after
    its writes, but for a failed send with its custom memory pool and deferred release
    overridden off; NIXL settles a lane's pending writes before stamping other values). Where
    one still reads, restamping can only get that write's own room refused. Cost: 16 bytes per
    page per lane.
    """

    def __init__(self, num_pages: int, lanes: int, device: torch.device | str = "cpu",
                 cost: CostMeter | None = None, path: str | None = None, heads: int = 1) -> None:
        if lanes < 1:
            raise ValueError(f"sglang-hardened H8: prefill needs at least one tag lane, not {lanes}")
        self.rows = torch.full((lanes, num_pages, TAG_WORDS * heads), UNSTAMPED, dtype=torch.int64, device=device)
        self.device: torch.device = self.rows.device
        self.lanes = [TagBuffer.over(rows, cost, path) for rows in self.rows.unbind(0)]
        self._by_thread: dict[int, TagBuffer] = {}
        self._lock = threading.Lock()

    def buf_info(self) -> tuple[int, int, int]:
        """(data_ptr, nbytes, item_len) of every lane together: what the engine registers."""
        return self.rows.data_ptr(), self.rows.nbytes, self.lanes[0].buf_info()[2]

    def lane(self) -> TagBuffer:
        """The calling thread's lane, given on its first call. A thread past the last lane raises
        rather than share one: upstream starts one sending thread per transfer queue, the count
        the lanes were made for, so more means a base this layer was not made for (on Mooncake
        the worker then stops as dead; on NIXL its rooms fail and decode refuses them)."""
        thread = threading.get_ident()
        lane = self._by_thread.get(thread)
        if lane is None:
            with self._lock:
                if len(self._by_thread) == len(self.lanes):
                    raise RuntimeError(f"sglang-hardened H8: more threads send KV than prefill has tag lanes "
                                       f"({len(self.lanes)}, one per transfer queue)")
                lane = self._by_thread[thread] = self.lanes[len(self._by_thread)]
        return lane


class PageTagMismatch(RuntimeError):
    """Raised by `DecodePageTags.admit` once a fail-closed node has seen a mismatch."""


class DecodePageTags:
    """Decode's tag buffer and its expectation table (room -> epoch of the current allocation).

    Seams: `allocate` where decode preallocates a request's pages (the epoch goes
    to prefill with the page indices); `release` wherever decode frees a
    request's pages (finish, abort, retraction: a retracted request that comes
    back is allocated again and gets a new epoch); `check` before the first
    decode step of a newly transferred request, in two halves on decode's loop
    (`start_check` once its transfer succeeded, `verdict` once `ready()`); `admit` where decode
    admits a request.
    """

    def __init__(self, num_pages: int, device: torch.device | str = "cpu",
                 fail_closed: bool | None = None, path: str | None = None, heads: int = 1) -> None:
        self.buffer = TagBuffer(num_pages, device, path=path, heads=heads)
        self._ops = self.buffer.ops
        if self.buffer.path == "torch":
            self._slots = HostSlots(self.buffer.device)
            # The device's event type; on CPU torch.cpu's, done when recorded (the stand-in
            # there: every CPU op has finished on return), as upstream's scheduler uses it.
            self.event: Callable[[], object] = torch.get_device_module(self.buffer.device).Event
        self.fail_closed = PAGE_TAGS_FAIL_CLOSED.get() if fail_closed is None else fail_closed
        self.expected: dict[int, int] = {}
        self._allocated: dict[int, Index] = {}  # room -> its current allocation's pages, for release
        # Page -> the room whose current allocation holds it (-1: none), on the host. A room whose
        # pages are handed out again was freed on a path that skips the release seam (a refusal
        # before H8's, a failed transfer released at once): its state goes then, so what these
        # tables hold is bounded by the pool, not by the server's life.
        self._owner = np.full(num_pages, -1, dtype=np.int64)
        self._owned: dict[int, np.ndarray] = {}  # room -> its pages as host indices into `_owner`
        self._last_epoch = 0
        self.mismatched_requests = 0
        self.mismatched_pages = 0
        self.closed_reason: str | None = None
        self.cost = CostMeter("decode", closing_op="release", unit="request")

    def allocate(self, room: int, pages: Pages) -> int:
        """Pages were just given to `room`: reset their rows, return the new epoch to send to prefill."""
        start = self.cost.start()
        idx = self._ops.index(pages)
        self._ops.clear(idx)  # before the bookkeeping: a bad index leaves no expectation behind
        # Upstream hands host (numpy) page indices over: no device read here.
        host = np.asarray(pages.numpy(force=True) if isinstance(pages, torch.Tensor) else pages, dtype=np.intp)
        owners = self._owner[host]
        for stale in np.unique(owners[owners >= 0]).tolist() + [room]:
            self._forget(stale)  # this room's earlier allocation, and rooms never released
        self._last_epoch += 1
        self.expected[room] = self._last_epoch
        self._allocated[room] = idx
        self._owned[room] = host
        self._owner[host] = room
        self.cost.add("allocate", start, 1, len(idx))
        return self._last_epoch

    def release(self, room: int) -> None:
        """`room` gives its current allocation's pages back (finished, aborted, retracted): a late
        write into them can only carry this allocation's epoch, which nobody expects any more."""
        start = self.cost.start()
        pages = self._forget(room)
        self.cost.add("release", start, 1, pages)

    def _forget(self, room: int) -> int:
        """Drop `room`'s epoch, page ownership and rows' stamps; the pages it held (0 if none)."""
        self.expected.pop(room, None)
        idx, host = self._allocated.pop(room, None), self._owned.pop(room, None)
        if host is not None:
            self._owner[host[self._owner[host] == room]] = -1
        if idx is None:
            return 0
        self._ops.clear(idx)
        return len(idx)

    def start_check(self, room: int, pages: Pages) -> Counted | PendingCount:
        """Compare the rows of `pages` with (room, its current epoch): the count of pages that do
        not match, on the host at once (numpy) or on its way there (torch: no wait for the
        device). One gather and one compare with the expected row."""
        start = self.cost.start()
        idx = self._ops.gather_index(pages)
        epoch = self.expected.get(room)
        epoch = UNSTAMPED - 1 if epoch is None else epoch  # no current allocation: no row can hold it
        if not len(idx):
            count: Counted | PendingCount = Counted(0, 0)
        elif isinstance(self._ops, TorchRows):
            count = PendingCount(self._slots, len(idx), self._ops.count_matching(idx, room, epoch), self.event)
        else:
            count = Counted(len(idx), self._ops.bad_pages(idx, room, epoch))
        self.cost.add("check", start, 1, len(idx))
        return count

    @staticmethod
    def fails(count: Counted | PendingCount) -> bool:
        """Whether a started check fails (no pages, or a page not the room's); counts nothing."""
        return not count.pages or count.bad() > 0

    def verdict(self, room: int, count: Counted | PendingCount) -> str | None:
        """None if every page of a started check carried (room, epoch); else the abort message,
        the mismatch counted and the policy applied."""
        return self._mismatch(room, count.bad(), count.pages) if self.fails(count) else None

    def check(self, room: int, pages: Pages) -> str | None:
        """`start_check` and its `verdict` at once: the torch path waits for the device (a
        decode's loop runs the two halves apart; the tests and the prefill peer, this)."""
        return self.verdict(room, self.start_check(room, pages))

    def _mismatch(self, room: int, bad: int, pages: int) -> str:
        """Count one failed request, apply the policy, and say what failed."""
        self.mismatched_requests += 1
        self.mismatched_pages += bad
        epoch = self.expected.get(room)
        what = (f"{bad} of its {pages} pages do not carry its tag (never written by its transfer, "
                f"written by another request, or given away)" if pages else "no pages were given to check")
        message = (
            f"sglang-hardened H8: request room={room} "
            f"{'has no current allocation' if epoch is None else f'epoch={epoch}'}: {what}; "
            f"aborting it rather than decoding over pages it cannot prove are its own"
        )
        log.error(message)
        metrics.refused("H8", "decode", "tag_mismatch")
        if self.fail_closed and self.closed_reason is None:
            self.closed_reason = message
            log.error("sglang-hardened H8: %s=1: this decode admits no more requests until restarted",
                      PAGE_TAGS_FAIL_CLOSED.name)
        return message

    def admit(self) -> None:
        """Raise once a fail-closed node has seen a mismatch: its pool can no longer be trusted."""
        if self.closed_reason is not None:
            metrics.refused("H8", "decode", "fail_closed")
            raise PageTagMismatch(f"sglang-hardened H8: this decode stopped admitting requests after: "
                                  f"{self.closed_reason}. Restart it.")
