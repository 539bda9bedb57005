"""H8 page tags at serving sizes: allocate, stamp and check one decode batch on the pool's device.

    python benchmarks/gpu_page_tags.py                 # CUDA: 1M-token pool, page 64, batch 256
    python benchmarks/gpu_page_tags.py --device cpu --pool-tokens 65536   # CPU's numpy path
    python benchmarks/gpu_page_tags.py --device cpu --pool-tokens 65536 --path torch

Each request gets pages_per_request pages (default: the pool shared evenly by
the batch) as its own int32 index tensor on the device, as SGLang's page
tables and page-index arrays are (the conversions the tag ops need are
timed with them). Timed per repeat, for every request of the batch: decode's
`allocate`, prefill's `stamp`, decode's `check` (one sync each: the seam
checks a request when its transfer completes) and decode's `release` (the
seams release a request's rows right after its check). The transfer between
the two buffers is the engine's work and is not timed. A second check after
a fault in every request (the chunk holding its first page lost) must refuse
the whole batch.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from sglang_hardened.common.table import format_table
from sglang_hardened.runtime.page_tags.rows import ROW_PATHS, DecodePageTags, TagBuffer, row_path


@dataclass(frozen=True)
class Measurement:
    batch: int
    pages_per_request: int
    allocate_s: float  # medians over the repeats, for the whole batch
    stamp_s: float
    check_s: float
    release_s: float
    failures_caught: int

    @property
    def pages(self) -> int:
        return self.batch * self.pages_per_request

    @property
    def total_s(self) -> float:
        return self.allocate_s + self.stamp_s + self.check_s + self.release_s


def _timed(device: torch.device, work) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(device: torch.device, pool_tokens: int, page_size: int, batch: int,
            pages_per_request: int | None = None, repeat: int = 5, path: str | None = None) -> Measurement:
    """Median costs of one batch's tag work on the device's row path (or `path`); raises if a
    clean batch is refused."""
    num_pages = pool_tokens // page_size
    per = pages_per_request or num_pages // batch
    decode = DecodePageTags(num_pages, device, fail_closed=False, path=path)
    prefill = TagBuffer(num_pages, device, path=path)
    gen = torch.Generator().manual_seed(0)
    rooms = torch.randint(0, 2**63 - 1, (batch,), generator=gen).tolist()
    times: list[tuple[float, float, float, float]] = []
    caught = 0
    for _ in range(repeat):
        dst, src = (torch.randperm(num_pages, generator=gen, dtype=torch.int32)[: batch * per].view(batch, per)
                    .to(device) for _ in range(2))
        # One tensor per request, split outside the timing: iterating a 2-D tensor (its unbind) is not H8's.
        requests, sources = list(zip(rooms, dst)), list(src)
        epochs: list[int] = []
        allocate = _timed(device, lambda: epochs.extend(decode.allocate(r, p) for r, p in requests))
        stamp = _timed(device, lambda: [prefill.stamp(s, r, e) for s, r, e in zip(sources, rooms, epochs)])
        decode.buffer.rows[dst.flatten()] = prefill.rows[src.flatten()]  # the engine's transfer
        verdicts: list[str | None] = []
        check = _timed(device, lambda: verdicts.extend(decode.check(r, p) for r, p in requests))
        if any(verdicts):
            raise AssertionError(f"a clean batch was refused: {next(v for v in verdicts if v)}")
        decode.buffer.clear(dst[:, 0])  # the chunk holding each request's first page was lost
        caught = sum(decode.check(r, p) is not None for r, p in requests)
        release = _timed(device, lambda: [decode.release(r) for r in rooms])
        times.append((allocate, stamp, check, release))
    allocate_s, stamp_s, check_s, release_s = (statistics.median(t) for t in zip(*times))
    return Measurement(batch, per, allocate_s, stamp_s, check_s, release_s, caught)


def report(m: Measurement) -> str:
    """Per page and per request, for each step and in all."""
    rows = [(name, f"{s * 1e6:.1f}", f"{s / m.batch * 1e6:.2f}", f"{s / m.pages * 1e9:.1f}")
            for name, s in (("decode allocate", m.allocate_s), ("prefill stamp", m.stamp_s),
                            ("decode check", m.check_s), ("decode release", m.release_s),
                            ("all", m.total_s))]
    table = format_table(("step", "batch us", "per request us", "ns per page"), rows)
    return f"{table}\nfaulty batch: {m.failures_caught} of {m.batch} requests refused"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pool-tokens", type=int, default=1 << 20)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--path", choices=tuple(ROW_PATHS), help="row operations (default: numpy on CPU, torch elsewhere)")
    args = parser.parse_args()
    logging.getLogger("sglang_hardened").setLevel(logging.CRITICAL)  # the faulty batch's refusals are expected
    device = torch.device(args.device)
    measure(device, args.pool_tokens, args.page_size, args.batch, repeat=2, path=args.path)  # warm-up: kernels, allocator
    m = measure(device, args.pool_tokens, args.page_size, args.batch, repeat=args.repeat, path=args.path)
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), "
          f"{row_path(device, args.path)} path, pool {args.pool_tokens} tokens, page {args.page_size}, "
          f"batch {m.batch} x {m.pages_per_request} pages")
    print(report(m))


if __name__ == "__main__":
    main()
