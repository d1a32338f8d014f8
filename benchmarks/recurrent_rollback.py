"""Rolling a Gated DeltaNet state back after a speculative step: keep a state per token in flight, or
keep the state before the pass and re-advance it over the accepted tokens? Measured on one block of
Qwen3-Next's shapes (hidden 2048, 16 key heads and 32 value heads of 128, conv kernel 4) with random
weights, one session, 8 drafts (a pass of 9 tokens: the accepted token and its drafts), after a
64-token prompt:

  keep states   the pass runs as 9 one-token steps and keeps each token's state (what transformers'
                assisted generation does when it records the past): a rollback copies one back;
                the block holds 10 states while the pass is in flight.
  re-advance    the pass runs the same way and keeps only its inputs; the state before it stays in
                the block's second slot (blocks/recurrent_state.py, what bloompeer does): a rollback
                re-advances that state over the accepted tokens' inputs, bitwise what sending only
                them gives; the block holds 2 states and the inputs of at most 32 tokens.
  chunked pass  for comparison, the pass as transformers' plain forward runs several tokens: the
                chunked algorithm (padded to 64 tokens), which gives no per-token state to keep.

Each case runs once per round, the cases interleaved, for --rounds rounds; printed: the minimum (the
figure a quiet machine gives) and the median, in milliseconds, and the bytes a block keeps per session
each way (float32 states, as transformers keeps them; windows and inputs in --dtype).

    python benchmarks/recurrent_rollback.py
    python benchmarks/recurrent_rollback.py --rounds 30 --dtype bfloat16

In bfloat16 on a CPU without bfloat16 arithmetic (this 2-core machine's), PyTorch's depthwise conv1d
is a slow path: 74 ms for a one-token step's 5 inputs of Qwen3-Next's 8192 channels, 0.35 ms in
float32 (transformers' own steps call the same op, so they pay it too). Each token of a pass run as
steps pays it once, so there a pass of 9 took 590 ms as steps against 74 ms chunked: the choice of
gated_deltanet.RECURRENT_PASS_TOKENS was measured in float32, and a bfloat16 CPU server wants its
convolution in float32 first.
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
from transformers import Qwen3NextConfig  # noqa: E402

from bloompeer.blocks.gated_deltanet import DeltaNetSegment, GatedDeltaNet  # noqa: E402
from bloompeer.blocks.recurrent_state import MAX_ROLLBACK_TOKENS, RecurrentState  # noqa: E402

CONFIG = dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, num_hidden_layers=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"])
DRAFTS = 8
PROMPT_TOKENS = 64
LINEAR_BLOCKS = 36  # Qwen3-Next-80B: 48 blocks, three of every four linear


def keep_every_state(layer: GatedDeltaNet, inputs: torch.Tensor, start) -> list:
    """The keep-states way's pass: one-token steps, each token's (window, state) kept."""
    kept = []
    for index in range(inputs.shape[1]):
        _, start = layer.mix(inputs[:, index:index + 1], start)
        kept.append(start)
    return kept


def cases(layer: GatedDeltaNet, hidden: torch.Tensor) -> dict:
    """name -> a function that runs it once."""
    linear = lambda module, rows: module(rows)  # noqa: E731
    inputs, _ = layer.project(hidden, linear)
    _, start = layer.mix(inputs[:, :PROMPT_TOKENS], None)
    drafted = inputs[:, PROMPT_TOKENS:]
    kept = keep_every_state(layer, drafted, start)
    slot = (torch.empty_like(start[0]), torch.empty_like(start[1]))
    state = RecurrentState(layer.layout, [layer.layer_idx], 1, hidden.dtype, hidden.device)
    state.begin_step(0, PROMPT_TOKENS)
    layer.compute(hidden[:, :PROMPT_TOKENS], linear, [DeltaNetSegment(1, PROMPT_TOKENS, state)])

    def whole_block_pass():
        state.begin_step(PROMPT_TOKENS, 1 + DRAFTS)
        layer.compute(hidden[:, PROMPT_TOKENS:], linear, [DeltaNetSegment(1, 1 + DRAFTS, state)])

    runs = {"one-token step": lambda: layer.mix(drafted[:, :1], start),
            "pass of 9 as one-token steps (both ways)": lambda: layer.mix(drafted, start),
            "pass of 9, keeping every state": lambda: keep_every_state(layer, drafted, start),
            "pass of 9, chunked (transformers' plain forward)": lambda: layer._mix_pass(drafted, start),
            "whole block's pass of 9 (projections, state kept)": whole_block_pass,
            "rollback, keep states (copy one back)": lambda: [s.copy_(k) for s, k in zip(slot, kept[3])]}
    for accepted in (1, 2, 4, 8):
        runs[f"rollback to {accepted} accepted, re-advance"] = \
            lambda accepted=accepted: layer.mix(drafted[:, :accepted], start)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    torch.manual_seed(0)
    layer = GatedDeltaNet(Qwen3NextConfig(**CONFIG), 0).to(device, dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0, 0.02)
    hidden = torch.randn(1, PROMPT_TOKENS + 1 + DRAFTS, CONFIG["hidden_size"], device=device, dtype=dtype)
    with torch.inference_mode():
        runs = cases(layer, hidden)
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(1000 * (time.perf_counter() - started))

    print(f"# one Gated DeltaNet block at Qwen3-Next's shapes, {args.dtype} on {device}, {DRAFTS} drafts, "
          f"{args.rounds} rounds (torch threads: {torch.get_num_threads()})")
    print(f"{'':55s} {'min ms':>9s} {'median ms':>10s}")
    for name, values in times.items():
        print(f"{name:55s} {min(values):9.2f} {statistics.median(values):10.2f}")
    layout = layer.layout
    element = torch.empty((), dtype=dtype).element_size()
    state_bytes = layout.heads * layout.key_dim * layout.value_dim * 4 + layout.conv_dim * layout.conv_window * element
    keep_states = (2 + DRAFTS) * state_bytes  # the state before the pass and one after each of its 9 tokens
    readvance = layout.nbytes(1, dtype, MAX_ROLLBACK_TOKENS)
    print(f"{'one state (32 heads x 128 x 128 float32, its window)':55s} {state_bytes / 2**20:9.2f} MiB")
    print(f"{'a block keeps, keep-states way (10 states)':55s} {keep_states / 2**20:9.2f} MiB")
    print(f"{f'a block keeps, re-advance way (2 states, {MAX_ROLLBACK_TOKENS} inputs)':55s} "
          f"{readvance / 2**20:9.2f} MiB")
    print(f"{f'a session over {LINEAR_BLOCKS} linear blocks: keep-states / re-advance':55s} "
          f"{LINEAR_BLOCKS * keep_states / 2**20:9.0f} / {LINEAR_BLOCKS * readvance / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
