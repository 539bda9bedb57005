"""H8 page tags on CPU: one request's allocate + stamp + check against the decode step it protects.

    python benchmarks/bench_page_tags.py --prompt-tokens 512 --repeat 50

The decode step is a stand-in, not SGLang: the tiny test model's forward for
one token (its shapes: 2 Llama layers, hidden 128, 4 heads / 2 KV heads of
32, MLP 256, vocab 512) as plain torch ops over a KV cache of the prompt's
length. Starting SGLang to time its step costs minutes on this 2-core host;
its real step adds scheduler work, so the share printed here is an upper
bound. The tag work runs once per request, a step runs once per token.
Both run on one torch thread: on a shared 2-core host two spinning OpenMP
threads make every small op 10-20x slower, and the ratio would measure that.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from sglang_hardened.table import format_table

from gpu_page_tags import measure  # benchmarks/ is on sys.path when run as a script

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=1, help="SGLang's default on CPU")
    parser.add_argument("--pool-tokens", type=int, default=65536)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    pages = -(-args.prompt_tokens // args.page_size)
    measure(cpu, args.pool_tokens, args.page_size, batch=1, pages_per_request=pages, repeat=5)  # warm-up
    m = measure(cpu, args.pool_tokens, args.page_size, batch=1, pages_per_request=pages, repeat=args.repeat)
    step = decode_step_s(args.prompt_tokens, args.repeat)
    rows = [(name, f"{s * 1e6:.1f}", f"{s / pages * 1e9:.1f}", f"{s / step * 100:.2f} %")
            for name, s in (("decode allocate", m.allocate_s), ("prefill stamp", m.stamp_s),
                            ("decode check", m.check_s), ("H8 in all", m.total_s))]
    rows.append(("tiny-model decode step (stand-in)", f"{step * 1e6:.1f}", "", "100 %"))
    print(f"one request, {args.prompt_tokens} tokens = {pages} pages of {args.page_size}; "
          f"medians of {args.repeat}; one torch thread")
    print(format_table(("what", "us", "ns per page", "share of a step"), rows))
    print(f"faulty request refused: {m.failures_caught == 1}")


if __name__ == "__main__":
    main()
