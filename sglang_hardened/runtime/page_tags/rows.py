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
pool's device, and one device-to-host sync per request. Two implementations
of the row operations share the rows' memory and one test suite: torch ops on
a GPU (what `benchmarks/gpu_page_tags.py` measures), numpy views on CPU, where
each torch call's fixed dispatch cost is most of the work (docs/page-tags.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

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

    def bad_pages(self, idx: torch.Tensor, room: int, epoch: int) -> int:
        """Pages among `idx` with a slot that is not (room, epoch): 0 with one wait for the
        device (the verdict read on the host); only a refusal pays for counting."""
        matching = self.matching(idx, room, epoch)
        if bool(matching.all()):
            return 0
        return int(matching.logical_not().sum())


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
    decode step of a newly transferred request; `admit` where decode admits a
    request.
    """

    def __init__(self, num_pages: int, device: torch.device | str = "cpu",
                 fail_closed: bool | None = None, path: str | None = None, heads: int = 1) -> None:
        self.buffer = TagBuffer(num_pages, device, path=path, heads=heads)
        self._ops = self.buffer.ops
        self.fail_closed = PAGE_TAGS_FAIL_CLOSED.get() if fail_closed is None else fail_closed
        self.expected: dict[int, int] = {}
        self._allocated: dict[int, Index] = {}  # room -> its current allocation's pages, for release
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
        self._last_epoch += 1
        self.expected[room] = self._last_epoch
        self._allocated[room] = idx
        self.cost.add("allocate", start, 1, len(idx))
        return self._last_epoch

    def release(self, room: int) -> None:
        """`room` gives its current allocation's pages back (finished, aborted, retracted): a late
        write into them can only carry this allocation's epoch, which nobody expects any more."""
        start = self.cost.start()
        self.expected.pop(room, None)
        idx = self._allocated.pop(room, None)
        if idx is not None:
            self._ops.clear(idx)
        self.cost.add("release", start, 1, 0 if idx is None else len(idx))

    def check(self, room: int, pages: Pages) -> str | None:
        """None if every page carries (room, its current epoch); else the abort message.

        One gather and one compare with the expected row (on a GPU, the one
        device-to-host sync per request).
        """
        start = self.cost.start()
        idx = self._ops.gather_index(pages)
        verdict = self._verdict(room, idx)
        self.cost.add("check", start, 1, len(idx))
        return verdict

    def _verdict(self, room: int, idx: Index) -> str | None:
        """`check` on page indices already fit for the gather."""
        if not len(idx):
            return self._mismatch(room, 0, 0)
        epoch = self.expected.get(room)
        # A room with no current allocation expects UNSTAMPED-1: no row can hold it.
        bad = self._ops.bad_pages(idx, room, UNSTAMPED - 1 if epoch is None else epoch)
        return None if bad == 0 else self._mismatch(room, bad, len(idx))

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
