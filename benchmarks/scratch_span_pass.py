"""Scratch (deleted before the branch is done): a batched pass of 8 one-token steps through 12 blocks of
bloom-560m's shape, through BlockSpan, with today's batched linears (OpenBLAS on an input-major copy) and
with oneDNN on the weights themselves, one thread, round robin; and one request alone (MKL) for scale."""
import statistics, sys, time
import torch
from threadpoolctl import threadpool_limits
from transformers import BloomConfig
sys.path.insert(0, "benchmarks")
import scratch_old_batched_linear as old
from bloompeer.blocks import BlockSpan, SessionCache, Segment
from bloompeer.blocks.batched_linear import BatchedLinears

torch.set_num_threads(1)
threadpool_limits(1, user_api="blas")
config = BloomConfig(hidden_size=1024, n_head=16, n_layer=24, vocab_size=1000)
with torch.device("meta"):
    span = BlockSpan(config, 0, 12)
span = span.to_empty(device="cpu")
for p in span.parameters():
    torch.nn.init.normal_(p, std=0.02)
span = span.eval().requires_grad_(False)
new, previous = BatchedLinears(span), old.BatchedLinears(span)
print("copy bytes: new", new.nbytes, "old", previous.nbytes)
ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
caches = [SessionCache(config, 0, 12, 1, 160, torch.float32) for _ in range(ROWS)]
for cache in caches:
    span(torch.randn(1, 128, 1024), cache.begin_step(0, None, 128), cache)
steps = [torch.randn(1, 1, 1024) for _ in range(ROWS)]

def batched(kernel):
    span.batched_linears = kernel
    segments = [Segment(step, cache.begin_step(128, None, 1), cache) for step, cache in zip(steps, caches)]
    return span.forward_segments(segments)

def alone():
    span.batched_linears = None
    return span(steps[0], caches[0].begin_step(128, None, 1), caches[0])

with torch.inference_mode():
    outputs = {"old": batched(previous), "new": batched(new)}
    one = [span(s, c.begin_step(128, None, 1), c) for s, c in zip(steps, caches)]
    for k, v in outputs.items():
        print(k, "max |batched - alone|", max(float((a - b).abs().max()) for a, b in zip(v, one)))
    cases = {"1 request alone (MKL)": alone, f"{ROWS} requests, OpenBLAS on input-major copy (before)": lambda: batched(previous),
             f"{ROWS} requests, oneDNN on the weights (now)": lambda: batched(new)}
    cpu = {k: [] for k in cases}; wall = {k: [] for k in cases}
    for _ in range(15):
        for k, fn in cases.items():
            c, s = time.thread_time(), time.perf_counter(); fn()
            cpu[k].append(time.thread_time() - c); wall[k].append(time.perf_counter() - s)
    for k in cases:
        print(f"{k:<55} CPU median {1e3 * statistics.median(cpu[k]):7.1f} ms   wall min {1e3 * min(wall[k]):7.1f} ms")
