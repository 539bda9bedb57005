"""H8: every KV page decode reads must carry the tag of the request reading it.

Each side keeps a small tag buffer beside its KV pool: one row per page, two
int64 words (bootstrap room, epoch). Decode picks a fresh epoch every time it
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
pool's device; a batch of requests costs one device-to-host sync.
"""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Sequence

import torch

# Rows a request can never match: rooms are >= 0 and epochs start at 1.
UNSTAMPED = -1
TAG_WORDS = 2  # room, epoch
FAIL_CLOSED_ENV = "SGLANG_HARDENED_PAGE_TAGS_FAIL_CLOSED"

log = logging.getLogger("sglang_hardened")

Pages = torch.Tensor | Sequence[int]


class TagBuffer:
    """One pool's tag rows: an (pages, 2) int64 tensor on the pool's device.

    Registered with the transfer engine as one more buffer; `buf_info` has the
    (ptr, nbytes, item_len) triple that SGLang's KV registration takes.
    """

    def __init__(self, num_pages: int, device: torch.device | str = "cpu") -> None:
        self.rows = torch.full((num_pages, TAG_WORDS), UNSTAMPED, dtype=torch.int64, device=device)
        # Made once, not per call: every request reads the device, and slicing the (room, epoch)
        # columns per stamp would cost an op each.
        self.device: torch.device = self.rows.device
        self._rooms, self._epochs = self.rows.unbind(1)

    def buf_info(self) -> tuple[int, int, int]:
        """(data_ptr, nbytes, item_len): item_len is one page's row, as KV item_len is one page."""
        return self.rows.data_ptr(), self.rows.nbytes, self.rows[0].nbytes

    def index(self, pages: Pages) -> torch.Tensor:
        """Page indices as an int64 tensor on this buffer's device (no copy if already one)."""
        return torch.as_tensor(pages, dtype=torch.int64, device=self.device)

    def stamp(self, pages: Pages, room: int, epoch: int) -> None:
        """Prefill: write (room, epoch) into the rows of the pages about to be sent."""
        idx = self.index(pages)
        # Two scalar fills, not one index_put_ of a (room, epoch) row: the row would be a host
        # tensor per call (an H2D copy that syncs on CUDA), and is no faster on CPU.
        self._rooms.index_fill_(0, idx, room)
        self._epochs.index_fill_(0, idx, epoch)

    def clear(self, pages: Pages) -> None:
        """Reset rows to UNSTAMPED: whatever the page held no longer vouches for anyone."""
        self.rows.index_fill_(0, self.index(pages), UNSTAMPED)


class PageTagMismatch(RuntimeError):
    """Raised by `DecodePageTags.admit` once a fail-closed node has seen a mismatch."""


class DecodePageTags:
    """Decode's tag buffer and its expectation table (room -> epoch of the current allocation).

    Seams: `allocate` where decode preallocates a request's pages (the epoch goes
    to prefill with the page indices); `release` wherever decode frees a
    request's pages (finish, abort, retraction: a retracted request that comes
    back is allocated again and gets a new epoch); `check_many` before the first
    decode step of newly transferred requests; `admit` where decode admits a
    request.
    """

    def __init__(self, num_pages: int, device: torch.device | str = "cpu",
                 fail_closed: bool | None = None) -> None:
        self.buffer = TagBuffer(num_pages, device)
        self.fail_closed = os.environ.get(FAIL_CLOSED_ENV) == "1" if fail_closed is None else fail_closed
        self.expected: dict[int, int] = {}
        self._last_epoch = 0
        self.mismatched_requests = 0
        self.mismatched_pages = 0
        self.closed_reason: str | None = None

    def allocate(self, room: int, pages: Pages) -> int:
        """Pages were just given to `room`: reset their rows, return the new epoch to send to prefill."""
        self._last_epoch += 1
        self.expected[room] = self._last_epoch
        self.buffer.clear(pages)
        return self._last_epoch

    def release(self, room: int, pages: Pages) -> None:
        """`room` gives its pages back (finished, aborted, retracted): a late write into them can
        only carry this allocation's epoch, which nobody expects any more."""
        self.expected.pop(room, None)
        self.buffer.clear(pages)

    def check(self, room: int, pages: Pages) -> str | None:
        """None if every page carries (room, its current epoch); else the abort message."""
        return self.check_many([(room, pages)])[0]

    def check_many(self, requests: Sequence[tuple[int, Pages]]) -> list[str | None]:
        """`check` for a batch: one gather, one fused compare, one device-to-host sync.

        The common case, every page matching, is decided by `torch.equal` over the
        gathered rows and the expected rows; only a failed batch pays for counting
        mismatches per request (on the host). Per-op overhead dominates at these
        sizes, so the op count is what is kept small.
        """
        if not requests:
            return []
        device = self.buffer.device
        idx = [self.buffer.index(pages) for _, pages in requests]
        counts = [len(i) for i in idx]
        # A room with no current allocation expects UNSTAMPED-1: no row can hold it. The (room,
        # epoch) rows go through an int64 array: a third of torch.tensor's cost from a list.
        words = array("q", [w for room, _ in requests for w in (room, self.expected.get(room, UNSTAMPED - 1))])
        keys = torch.frombuffer(words, dtype=torch.int64).view(-1, TAG_WORDS).to(device)
        got = self.buffer.rows.index_select(0, idx[0] if len(idx) == 1 else torch.cat(idx))
        expect = (keys.expand_as(got) if len(idx) == 1 else
                  keys.repeat_interleave(torch.tensor(counts, device=device), dim=0, output_size=len(got)))
        if all(counts) and torch.equal(got, expect):
            return [None] * len(requests)
        bad = got.ne(expect).any(dim=1).tolist()
        verdicts: list[str | None] = []
        start = 0
        for (room, _), n in zip(requests, counts):
            n_bad = sum(bad[start:start + n])
            start += n
            verdicts.append(self._mismatch(room, n_bad, n) if n_bad or not n else None)
        return verdicts

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
        if self.fail_closed and self.closed_reason is None:
            self.closed_reason = message
            log.error("sglang-hardened H8: %s=1: this decode admits no more requests until restarted",
                      FAIL_CLOSED_ENV)
        return message

    def admit(self) -> None:
        """Raise once a fail-closed node has seen a mismatch: its pool can no longer be trusted."""
        if self.closed_reason is not None:
            raise PageTagMismatch(f"sglang-hardened H8: this decode stopped admitting requests after: "
                                  f"{self.closed_reason}. Restart it.")
