"""H8 page tags on CPU: one request's allocate + stamp + check against the decode step it protects.

    python benchmarks/bench_page_tags.py --prompt-tokens 512 --repeat 200
    python benchmarks/bench_page_tags.py --step-from-cluster 0.5.23   # + SGLang's real step and H8 in it (minutes)

Two decode steps to compare with. The stand-in, always measured: the tiny
test model's forward for one token (its shapes: 2 Llama layers, hidden 128,
4 heads / 2 KV heads of 32, MLP 256, vocab 512) as plain torch ops over a KV
cache of the prompt's length, with no scheduler around it. The real one,
with --step-from-cluster: a hardened CPU PD cluster of that base (the
sandbox's, as bench_cluster.py starts it) serving greedy requests of the
prompt's length one at a time; a step is the difference in latency between
a long and a short answer over the difference in tokens, so prefill, the
transfer, H8's own check and HTTP cancel out. The same cluster logs H8's
cost for every request where it runs (`page_tags.cost`, one line a request:
the servers' own page indices and cache state): their means per request
are set against its step too. Tag work runs once per request, a step once
per token: the amortised share spreads it over --output-tokens steps. The
tag work here runs on one torch thread: on a shared 2-core host two spinning
OpenMP threads make every small op 10-20x slower, and the ratio would
measure that.

With --growth, one request's H8 work (on CPU's numpy path and on the torch
path a GPU runs, timed alike) and H3's (prefill's stamp of the tokens it
covers, the sender's shortfall check, decode's comparison) at each page
count, against the stand-in step at that context: upstream does none of
this work, so its cost is the hardened build's difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
# benchmarks/ is on sys.path when run as a script
from bench_cluster import PROMPT, SAFE
from cli_args import ints
from gpu_page_tags import measure
from growth_plot import plot_growth

from sglang_hardened.common.knobs import PAGE_TAGS_COST_EVERY
from sglang_hardened.common.table import format_table
from sglang_hardened.operations.oracle import generate
from sglang_hardened.runtime import coverage
from sglang_hardened.runtime.page_tags.rows import ROW_PATHS
from sglang_hardened.runtime.page_tags.cost import read_cost_lines
from sglang_hardened.sandbox.cluster import ClusterParams, start
from sglang_hardened.sandbox.env import build_env, default_overlay, wheels_for
from sglang_hardened.sandbox.model import ensure_model

SHORT_ANSWER = 8  # tokens of the answer the long one is compared with

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 128, 2, 4, 2, 32, 256, 512


def decode_step_s(context: int, repeat: int) -> float:
    """Median seconds of one token's forward through the tiny model's shapes."""
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    layers = [(w(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), w(HEADS * HEAD_DIM, HIDDEN), w(HIDDEN, 2 * MLP),
               w(MLP, HIDDEN), w(1, KV_HEADS, context, HEAD_DIM), w(1, KV_HEADS, context, HEAD_DIM))
              for _ in range(LAYERS)]
    head = w(HIDDEN, VOCAB)
    x0 = w(1, HIDDEN)

    def step() -> torch.Tensor:
        x = x0
        for qkv_w, o_w, up_w, down_w, k, v in layers:
            h = F.rms_norm(x, (HIDDEN,))
            q, _, _ = (h @ qkv_w).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            a = F.scaled_dot_product_attention(q.view(1, HEADS, 1, HEAD_DIM), k, v, enable_gqa=True)
            x = x + a.reshape(1, -1) @ o_w
            gate, up = (F.rms_norm(x, (HIDDEN,)) @ up_w).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ down_w
        return (F.rms_norm(x, (HIDDEN,)) @ head).argmax(-1)

    step()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


@dataclass(frozen=True)
class InSitu:
    """One H8 operation in the servers, per request (means over the requests sent)."""

    wall_s: float
    cpu_s: float
    pages: float


@dataclass(frozen=True)
class ClusterStep:
    """SGLang's decode step at batch 1, one estimate per request pair, the prompt it followed, and
    what each H8 operation cost per request in the same servers."""

    per_pair_s: list[float]
    prompt_tokens: int
    load: float  # the host's 1-minute load average when the pairs were done: other work slows a step
    in_situ: dict[str, InSitu]  # by operation

    @property
    def median_s(self) -> float:
        return statistics.median(self.per_pair_s)


def cluster_step(base: str, prompt_tokens: int, output_tokens: int, repeat: int) -> ClusterStep:
    """Time SGLang's decode step on a hardened CPU PD cluster of `base` (started and stopped here).

    Each pair of requests differs only in answer length (EOS ignored), so the
    difference in latency is `output_tokens` decode steps and nothing else.
    """
    env = build_env(base, wheels_for(base, hardened=True), default_overlay())
    cluster = start(env, ClusterParams(base=base, extra_env=(f"{PAGE_TAGS_COST_EVERY.name}=1",), **SAFE), ensure_model(env))
    try:
        def ask(text: str, tokens: int) -> tuple[float, dict]:
            sampling = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
            reply = generate(cluster.lb_url, text, tokens, extra={"sampling_params": sampling})
            if reply.status != 200:
                raise SystemExit(f"request failed: {reply.status} {reply.body[:200]}")
            meta = json.loads(reply.body)["meta_info"]
            if meta["completion_tokens"] != tokens:
                raise SystemExit(f"asked for {tokens} tokens, got {meta['completion_tokens']}")
            return reply.seconds, meta

        def cost_lines(role: str):
            return [line for line in read_cost_lines(Path(cluster.procs[role].log).read_text(errors="replace"))
                    if line.role == role]

        _, meta = ask(PROMPT, 1)  # the tokenizer's count for PROMPT sizes the real prompt
        text = PROMPT * max(1, round(prompt_tokens / meta["prompt_tokens"]))
        before = {role: len(cost_lines(role)) for role in ("prefill", "decode")}
        steps = []
        for _ in range(repeat):
            short, meta = ask(text, SHORT_ANSWER)
            long, _ = ask(text, SHORT_ANSWER + output_tokens)
            steps.append((long - short) / output_tokens)
        requests = 2 * repeat
        in_situ = {}  # the servers' H8 time over the pairs, per request: means, as cost is summed
        for role in ("decode", "prefill"):
            lines = cost_lines(role)[before[role]:]
            for op in dict.fromkeys(op for line in lines for op in line.cpu_us):
                timed = [line for line in lines if op in line.cpu_us]  # one request (one send) each
                in_situ[op] = InSitu(sum(line.wall_us[op] for line in timed) / requests / 1e6,
                                     sum(line.cpu_us[op] for line in timed) / requests / 1e6,
                                     sum(line.pages[op] for line in timed) / requests)
        return ClusterStep(steps, meta["prompt_tokens"], os.getloadavg()[0], in_situ)
    finally:
        cluster.stop()


def h3_request_s(pages: int, repeat: int) -> float:
    """Median seconds of H3's per-request work for a prompt of `pages` one-token pages: prefill's
    stamp into a metadata row, the sender's shortfall check, decode's comparison."""
    row = torch.zeros(16, dtype=torch.int64)  # one metadata row, as SGLang's buffers hold it
    req = SimpleNamespace(origin_input_ids=list(range(pages)), bootstrap_host="10.0.0.1", rid="r", bootstrap_room=1)
    chunk = SimpleNamespace(index_slice=slice(0, pages), is_last_chunk=True, room=1)
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        coverage.stamp(row, req)
        shortfall = coverage.sender_shortfall(chunk, pages)
        reason = coverage.uncovered_reason(req, row)
        runs.append(time.perf_counter() - start)
        if shortfall or reason:
            raise AssertionError(f"a covered request was refused: {shortfall or reason}")
    return statistics.median(runs)


def growth(page_counts: list[int], repeat: int, plot: Path | None) -> None:
    """The growth table (and plot): H8 on both row paths and H3, per request, by page count."""
    torch.set_num_threads(1)
    cpu, rows, series = torch.device("cpu"), [], {"H8, numpy (CPU)": [], "H8, torch": [], "H3": [], "stand-in step": []}
    for pages in page_counts:
        pool = max(65536, 4 * pages)
        h8 = {}
        for path in ROW_PATHS:
            measure(cpu, pool, 1, batch=1, pages_per_request=pages, repeat=5, path=path)  # warm-up
            h8[path] = measure(cpu, pool, 1, batch=1, pages_per_request=pages, repeat=repeat, path=path).total_s
        h3, step = h3_request_s(pages, repeat), decode_step_s(pages, repeat)
        for label, s in zip(series, (h8["numpy"], h8["torch"], h3, step)):
            series[label].append((pages, s * 1e6))
        rows.append((str(pages), f"{h8['numpy'] * 1e6:.1f}", f"{h8['numpy'] / pages * 1e9:.1f}",
                     f"{h8['torch'] * 1e6:.1f}", f"{h8['torch'] / pages * 1e9:.1f}", f"{h3 * 1e6:.1f}",
                     f"{step * 1e6:.0f}", f"{(h8['numpy'] + h3) / step * 100:.2f} %"))
    print(f"one request of one-token pages (SGLang's CPU default); medians of {repeat}; one torch thread; "
          f"host load {os.getloadavg()[0]:.1f}")
    print(format_table(("pages", "H8 numpy us", "ns/page", "H8 torch us", "ns/page", "H3 us", "stand-in step us",
                        "(H8 numpy + H3) / step"), rows))
    if plot:
        plot_growth(plot, "H3 and H8 per request, by prompt pages", "pages (one token each)",
                    "microseconds per request", series)
        print(f"plot: {plot}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="example: python benchmarks/"
                                     "bench_page_tags.py --growth 16,64,256,1024,4096 --plot growth.png")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=1, help="SGLang's default on CPU")
    parser.add_argument("--pool-tokens", type=int, default=65536)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--step-from-cluster", metavar="BASE",
                        help="also time SGLang's real decode step on a hardened CPU PD cluster of BASE")
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="answer length: the real step's measure and the amortised share")
    parser.add_argument("--cluster-repeat", type=int, default=10, help="request pairs sent to the cluster")
    parser.add_argument("--growth", type=ints, metavar="PAGES,...", help="H3's and H8's cost per request at these page counts")
    parser.add_argument("--plot", type=Path, help="with --growth: a PNG of the costs against the page count")
    args = parser.parse_args(argv)
    logging.getLogger("sglang_hardened").setLevel(logging.CRITICAL)  # the fault check's refusals are expected
    if args.growth:
        growth(args.growth, args.repeat, args.plot)
        return
    real = (cluster_step(args.step_from_cluster, args.prompt_tokens, args.output_tokens, args.cluster_repeat)
            if args.step_from_cluster else None)  # first and alone: the cluster's servers would share the CPU
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    pages = -(-args.prompt_tokens // args.page_size)
    measure(cpu, args.pool_tokens, args.page_size, batch=1, pages_per_request=pages, repeat=5)  # warm-up
    m = measure(cpu, args.pool_tokens, args.page_size, batch=1, pages_per_request=pages, repeat=args.repeat)
    steps = {"stand-in": decode_step_s(args.prompt_tokens, args.repeat)}
    if real:
        steps = {f"SGLang {args.step_from_cluster}": real.median_s, **steps}
    parts = (("decode allocate", m.allocate_s), ("prefill stamp", m.stamp_s), ("decode check", m.check_s),
             ("decode release", m.release_s), ("decode's part (all but the stamp)", m.total_s - m.stamp_s),
             ("H8 in all, once per request", m.total_s))

    def row(name: str, s: float, ns_per_page: float) -> tuple[str, ...]:
        return name, f"{s * 1e6:.1f}", f"{ns_per_page:.1f}", *(f"{s / st * 100:.2f} %" for st in steps.values())

    rows = [row(name, s, s / pages * 1e9) for name, s in parts]
    if real:  # what the servers' own cost lines say: the thread's CPU time, then the total's wall time
        cost = real.in_situ
        rows += [row(f"{'prefill' if op == 'stamp' else 'decode'} {op}, in the servers, cpu", c.cpu_s,
                     c.cpu_s / c.pages * 1e9) for op, c in cost.items()]
        request_pages = max(c.pages for c in cost.values())  # as above: the total over one request's pages
        for clock in ("cpu", "wall"):
            s = sum(getattr(c, f"{clock}_s") for c in cost.values())
            rows.append(row(f"H8 in all, in the servers, {clock}", s, s / request_pages * 1e9))
    rows += [(f"decode step, {name}, once per token", f"{st * 1e6:.1f}", "",
              *("100 %" if n == name else "" for n in steps)) for name, st in steps.items()]
    print(f"one request, {args.prompt_tokens} tokens = {pages} pages of {args.page_size}; "
          f"medians of {args.repeat}; one torch thread; host load {os.getloadavg()[0]:.1f}")
    if real:
        print(f"SGLang step: hardened {args.step_from_cluster} CPU PD cluster, tiny model, batch 1, "
              f"{real.prompt_tokens}-token prompt, {SHORT_ANSWER + args.output_tokens}- minus {SHORT_ANSWER}-token "
              f"answers; median of {len(real.per_pair_s)} pairs (from {min(real.per_pair_s) * 1e6:.0f} "
              f"to {max(real.per_pair_s) * 1e6:.0f} us); host load {real.load:.1f}")
    print(format_table(("what", "us", "ns per page", *(f"share of {n} step" for n in steps)), rows))
    amortised = (f"{m.total_s / (st * args.output_tokens) * 100:.3f} % of {n} decoding" for n, st in steps.items())
    print(f"amortised over a {args.output_tokens}-token answer (H8 once, {args.output_tokens} steps): "
          + ", ".join(amortised))
    print(f"faulty request refused: {m.failures_caught == 1}")


if __name__ == "__main__":
    main()
