"""SGLang's overlap loop emulated on one GPU, with H8's decode check per admitted request: torch
only, no SGLang; what the check's host-device synchronisation costs the loop's throughput.

    python benchmarks/gpu_overlap.py                     # CUDA: 10 repeats of 300 steps per arm
    python benchmarks/gpu_overlap.py --device cpu --steps 4 --repeats 2 --hidden 64 --layers 1 \\
        --prepare-us 0                                   # degenerate: runs every path, measures nothing

The loop is SGLang's decode overlap loop (``event_loop_overlap_disagg_decode``) in outline.
Each iteration, on the scheduler's own stream: admit the requests whose transfer completed
(H8's check runs here, in ``_commit_transfer_to_req``); prepare the next batch (``--prepare-us``
of the host's own work, plus a small op on the scheduler's stream); launch the forward on a
side stream (``--layers`` matmuls of ``--batch`` x ``--hidden``, the next tokens copied to
pinned memory with an event), after which the scheduler's stream waits for the forward (the
write-after-read barrier, ``Scheduler._apply_war_barrier``: in its coarse form by default,
``--barrier early`` for its fine one, which waits only for the forward's first layer, as a decode
CUDA graph's in-graph marker lets it); then process
the previous step's result (its event waited for: upstream's own synchronisation, once a step).
A request is admitted every ``--admit-every`` steps, its pages (``--pages`` rows of the tag
table) stamped beforehand as a transfer leaves them; every ``--fault-every``-th one is not
stamped, and must be refused.

Arms, interleaved in a random order each repeat:

- ``upstream``: no check.
- ``sync``: the check as the runtime ran it on CUDA before it was split, and as
  ``DecodePageTags.check`` still runs it: a gather and two compares on the device, then the
  verdict read on the host, which waits for it. Behind the barrier, it waits for the forward in
  flight: the host cannot prepare the next step meanwhile.
- ``async``: the check as decode's loop runs it now (``page_tags.seams.verdict_pending``): the
  same gather and compares queued on the device (``DecodePageTags.start_check``), the count
  copied to pinned memory behind an event; the verdict read at a later iteration's admission
  once the event has completed (``ready()``, no wait; ``DecodePageTags.verdict``), before the
  request joins a batch (its first decode step), so a request may start a step later
  (docs/performance.md).

Reported: each arm's steps per second, the mean step, and each arm's ratio to ``upstream`` over
the repeats (median, distribution-free interval), with the requests each arm refused. On CPU
(``--device cpu``) there are no streams or events and nothing runs beside the host: every path
runs (the unit tests keep it from rotting) and the figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
from stats import median_interval  # benchmarks/ is on sys.path when run as a script

from sglang_hardened.common.table import format_table
from sglang_hardened.runtime.page_tags.rows import TAG_WORDS, DecodePageTags, PendingCount

ARMS = ("upstream", "sync", "async")


class Streams:
    """The two CUDA streams and their events, or on CPU stand-ins that do nothing (every CPU op
    is done on return)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.schedule = torch.cuda.Stream(device) if self.cuda else None
        self.forward = torch.cuda.Stream(device) if self.cuda else None

    def on(self, stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait(self, waiting, waited) -> None:
        if self.cuda:
            waiting.wait_stream(waited)

    def event(self):
        """A recorded event on the current stream (CPU: torch.cpu's, done when recorded)."""
        event = (torch.cuda.Event if self.cuda else torch.cpu.Event)()
        event.record()
        return event


@dataclass
class Loop:
    """One arm's loop state: the model stand-in, the tag table and its requests."""

    device: torch.device
    streams: Streams
    args: argparse.Namespace
    tags: DecodePageTags = field(init=False)
    weights: list[torch.Tensor] = field(init=False)
    x: torch.Tensor = field(init=False)
    next_tokens: torch.Tensor = field(init=False)
    pending: list[tuple[int, PendingCount]] = field(default_factory=list)  # async: (room, its count on the way)
    refused: int = 0
    admitted: int = 0

    def __post_init__(self) -> None:
        a = self.args
        gen = torch.Generator().manual_seed(0)
        self.weights = [(torch.randn(a.hidden, a.hidden, generator=gen) / a.hidden ** 0.5).to(self.device)
                        for _ in range(a.layers)]
        self.x = torch.randn(a.batch, a.hidden, generator=gen).to(self.device)
        self.next_tokens = torch.empty(a.batch, dtype=torch.int64, pin_memory=self.streams.cuda)
        requests = a.steps // a.admit_every + 1
        self.tags = DecodePageTags(requests * a.pages, self.device, fail_closed=False, path="torch")

    def _pages(self, request: int) -> torch.Tensor:
        """The request's pages: its own rows of the table, as an int32 page table on the device."""
        first = request * self.args.pages
        return torch.arange(first, first + self.args.pages, dtype=torch.int32, device=self.device)

    def transferred(self, request: int) -> tuple[int, torch.Tensor]:
        """Allocate the request's pages and stamp them as its transfer would (every --fault-every-th
        not: a transfer that left its pages unwritten). Not timed: the preallocation queue and the
        engine's work, on earlier iterations."""
        room, pages = request + 1, self._pages(request)
        epoch = self.tags.allocate(room, pages)
        if not (self.args.fault_every and request % self.args.fault_every == self.args.fault_every - 1):
            rows = self.tags.buffer.rows
            rows[pages.long(), 0::TAG_WORDS], rows[pages.long(), 1::TAG_WORDS] = room, epoch
        return room, pages

    def admit(self, room: int, pages: torch.Tensor, arm: str) -> None:
        """H8's check for one request, as the arm runs it."""
        if arm == "sync":
            self._verdict(self.tags.check(room, pages) is None)
        elif arm == "async":
            self.pending.append((room, self.tags.start_check(room, pages)))

    def read_verdicts(self, wait: bool = False) -> None:
        """Async: the verdicts whose counts are on the host (all of them, waiting, with ``wait``)."""
        still = []
        for room, count in self.pending:
            if wait or count.ready():
                self._verdict(self.tags.verdict(room, count) is None)
            else:
                still.append((room, count))
        self.pending = still

    def _verdict(self, ok: bool) -> None:
        self.admitted += 1
        self.refused += not ok

    def forward(self) -> object:
        """One step's forward on the side stream; its next tokens copied out; the event after;
        then the scheduler's stream made to wait for it (``--barrier``)."""
        s = self.streams
        s.wait(s.forward, s.schedule)
        with s.on(s.forward):
            x = self.x
            for layer, w in enumerate(self.weights):
                x = torch.tanh(x @ w)
                if layer == 0:
                    read_done = s.event()  # the forward's reads of the scheduler's buffers are over
            self.next_tokens.copy_(x.argmax(dim=1), non_blocking=True)
            done = s.event()
        if self.args.barrier == "forward":
            s.wait(s.schedule, s.forward)
        elif s.cuda:
            s.schedule.wait_event(read_done)
        return done


def busy(us: float) -> None:
    """The host's own work preparing a step (SGLang's scheduling in Python), spun, not slept."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def run(loop: Loop, arm: str) -> float:
    """The loop's steps per second over ``--steps`` steps, after the arm's requests are checked."""
    a, s = loop.args, loop.streams
    requests = [loop.transferred(r) for r in range(a.steps // a.admit_every + 1)]
    if s.cuda:
        torch.cuda.synchronize(loop.device)
    previous = None
    start = time.perf_counter()
    with s.on(s.schedule):
        for step in range(a.steps):
            loop.read_verdicts()
            if step % a.admit_every == 0:
                loop.admit(*requests[step // a.admit_every], arm)
            busy(a.prepare_us)
            loop.x.add_(0)  # the batch's own inputs, prepared on the scheduler's stream
            done = loop.forward()
            if previous is not None:
                previous.synchronize()  # upstream's own: the previous step's next tokens
            previous = done
        previous.synchronize()
    took = time.perf_counter() - start
    loop.read_verdicts(wait=True)
    return a.steps / took


@dataclass
class Result:
    steps_per_s: dict[str, list[float]]
    refused: dict[str, int]
    admitted: dict[str, int]


def measure(args: argparse.Namespace) -> Result:
    """Every arm ``--repeats`` times, in a random order each repeat, on fresh loops."""
    device = torch.device(args.device)
    streams = Streams(device)
    order = random.Random(args.seed)
    found = Result({a: [] for a in ARMS}, {a: 0 for a in ARMS}, {a: 0 for a in ARMS})
    run(Loop(device, streams, args), "sync")  # warm-up: kernels, allocator, pinned memory
    for _ in range(args.repeats):
        for arm in order.sample(ARMS, len(ARMS)):
            loop = Loop(device, streams, args)
            found.steps_per_s[arm].append(run(loop, arm))
            found.refused[arm] += loop.refused
            found.admitted[arm] += loop.admitted
    return found


def report(found: Result) -> str:
    rows = []
    base = found.steps_per_s["upstream"]
    for arm in ARMS:
        rates = found.steps_per_s[arm]
        med, lo, hi, coverage = median_interval([r / b for r, b in zip(rates, base)])
        rows.append([arm, f"{statistics.median(rates):.1f}", f"{1e3 / statistics.median(rates):.3f}",
                     f"{med:.4f} [{lo:.4f}, {hi:.4f}] ({100 * coverage:.2f} %)",
                     f"{found.refused[arm]} of {found.admitted[arm]}"])
    return format_table(["arm", "steps/s (median)", "ms/step", "steps/s ratio to upstream", "refused"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="example: python benchmarks/gpu_overlap.py --steps 300 --repeats 10 "
                                            "--admit-every 2",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=300, help="loop iterations per arm and repeat")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128, help="rows of the forward's input (running requests)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16, help="matmuls per forward: sets the step's length")
    parser.add_argument("--prepare-us", type=float, default=2000.0, help="the host's own work per step")
    parser.add_argument("--admit-every", type=int, default=2, help="steps per admitted request")
    parser.add_argument("--pages", type=int, default=32, help="pages per admitted request")
    parser.add_argument("--fault-every", type=int, default=10, help="every Nth request's pages are left unstamped")
    parser.add_argument("--barrier", choices=("forward", "early"), default="forward",
                        help="what the scheduler's stream waits for after a launch: the whole forward (SGLang's "
                             "coarse barrier) or its first layer (the fine one)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if min(args.steps, args.repeats, args.admit_every, args.pages, args.layers) < 1 or args.prepare_us < 0:
        parser.error("--steps, --repeats, --admit-every, --pages and --layers at least 1; --prepare-us at least 0")
    logging.getLogger("sglang_hardened").setLevel(logging.CRITICAL)  # the faulty requests' refusals are expected
    found = measure(args)
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU: degenerate, measures nothing"
    print(f"{card}; batch {args.batch} x {args.hidden}, {args.layers} layers, {args.barrier} barrier, "
          f"prepare {args.prepare_us:.0f} us, "
          f"a request every {args.admit_every} steps, {args.pages} pages each, {args.repeats} repeats of "
          f"{args.steps} steps")
    print(report(found))


if __name__ == "__main__":
    main()
