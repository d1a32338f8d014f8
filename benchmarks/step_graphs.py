"""A span's decode step on a GPU, eager and replayed as a CUDA graph (blocks/step_graphs.py), in the same run.

24 blocks of bloom-560m's shape (hidden 1024, 16 heads; random weights, no checkpoint) in bfloat16, their
linear weights stored as none (bfloat16), int8 or int4, as `serve --quant` stores them. Sessions of one row,
each after a prompt of --context tokens in a cache of --max-length; for each count of sessions stepping
together (--sessions), the median time of a decode step, eager and graphed: the pass's caches begun, its
inputs in, its outputs on the GPU, synchronized. Every step is at the same position (the cache rewound by
one token), so all steps attend over the same length. Goals (issue 42): one session's graphed bfloat16 step
<= 2 ms; int8 and int4 no slower than bfloat16.

    python benchmarks/step_graphs.py [--steps 100] [--formats none int8 int4] [--sessions 1 8]
    python benchmarks/step_graphs.py --device cpu --blocks 2 --hidden 64 --heads 4 --formats none  # eager only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import BloomConfig  # noqa: E402

from bloompeer.blocks import Segment  # noqa: E402
from bloompeer.blocks.bloom import BloomSpan  # noqa: E402
from bloompeer.blocks.quantized_linear import quantize_block  # noqa: E402
from bloompeer.blocks.step_graphs import StepGraphs  # noqa: E402
from bloompeer.weight_format import WeightFormat  # noqa: E402

GOAL_MS = 2.0  # one session's graphed bfloat16 step through 24 bloom-560m blocks


def build_span(args, quant: str) -> BloomSpan:
    config = BloomConfig(vocab_size=256, hidden_size=args.hidden, n_head=args.heads, n_layer=args.blocks)
    torch.manual_seed(0)
    with torch.device(args.device):
        span = BloomSpan(config, 0, args.blocks)
    span = span.to(getattr(torch, args.dtype)).eval().requires_grad_(False)
    weights = WeightFormat.of(quant, dtype=args.dtype, device=args.device)
    for block in span.blocks:
        quantize_block(block, weights)
    return span


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def time_steps(span: BloomSpan, args, sessions: int, graphed: bool) -> tuple[float, dict]:
    """The median decode step (ms) of `sessions` sessions stepping together, and StepGraphs' counts."""
    dtype, device = getattr(torch, args.dtype), args.device
    caches = [span.new_cache(0, args.blocks, 1, args.max_length, dtype, device) for _ in range(sessions)]
    for cache in caches:
        prompt = torch.randn(1, args.context, args.hidden, dtype=dtype, device=device)
        span(prompt, cache.begin_step(0, None, args.context), cache)
    graphs = StepGraphs(span) if graphed else None
    hidden = [torch.randn(1, 1, args.hidden, dtype=dtype, device=device) for _ in range(sessions)]
    times_ms = []
    for index in range(args.warmup + args.steps):
        sync(device)
        started = time.perf_counter()
        segments = [Segment(h, cache.begin_step(args.context, None, 1), cache) for h, cache in zip(hidden, caches)]
        if graphs is not None:
            graphs.forward(segments, 0, args.blocks)
        else:
            span.forward_segments(segments, 0, args.blocks)
        sync(device)
        if index >= args.warmup:
            times_ms.append(1000 * (time.perf_counter() - started))
    return statistics.median(times_ms), (graphs.counts if graphs else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps")
    parser.add_argument("--max-length", type=int, default=2048, help="each session's preallocated cache")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--formats", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (a graph is captured on the 2nd)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(args.device) if cuda else "CPU (eager only: graphs need CUDA)"
    print(f"torch {torch.__version__} on {name}; {args.blocks} blocks of hidden {args.hidden}, {args.heads} heads, "
          f"{args.dtype}; prompt {args.context}, max_length {args.max_length}; median of {args.steps} steps")
    results = {}
    for quant in args.formats:
        span = build_span(args, quant)
        for sessions in args.sessions:
            eager_ms, _ = time_steps(span, args, sessions, graphed=False)
            graphed_ms, counts = time_steps(span, args, sessions, graphed=True) if cuda else (float("nan"), {})
            if cuda and counts.get("replay", 0) != args.warmup + args.steps - 2:
                raise SystemExit(f"expected every step after the 2nd replayed, got {counts}")
            results[quant, sessions] = eager_ms, graphed_ms
        del span
        if cuda:
            torch.cuda.empty_cache()
    print(f"\n{'weights':<9} {'sessions':>8} {'eager ms':>9} {'graphed ms':>10} {'speedup':>8} "
          f"{'eager / none':>12} {'graphed / none':>14}")
    for (quant, sessions), (eager_ms, graphed_ms) in results.items():
        base = results.get(("none", sessions), (float("nan"), float("nan")))
        print(f"{quant:<9} {sessions:>8} {eager_ms:>9.2f} {graphed_ms:>10.2f} {eager_ms / graphed_ms:>8.1f} "
              f"{eager_ms / base[0]:>12.2f} {graphed_ms / base[1]:>14.2f}")
    if cuda and ("none", 1) in results:
        step_ms = results["none", 1][1]
        print(f"\ngoal: one session's graphed {args.dtype} step <= {GOAL_MS} ms: {step_ms:.2f} ms, "
              f"{'met' if step_ms <= GOAL_MS else 'NOT met'}")
        for quant in ("int8", "int4"):
            if (quant, 1) in results:
                ratio = results[quant, 1][1] / step_ms
                print(f"goal: {quant} no slower than {args.dtype} (graphed, one session): {ratio:.2f}x, "
                      f"{'met' if ratio <= 1.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
