"""Rolling a Gated DeltaNet state back after a speculative step: keep a state per token in flight, or
keep the state before the pass and re-advance it over the accepted tokens? Both measured here, on
one block of Qwen3-Next's shapes (hidden 2048, 16 key heads and 32 value heads of 128, conv kernel 4)
with random weights, one session, 8 drafts (a pass of 9 tokens: the accepted token and the drafts):

  keep states  the pass runs the recurrent rule token by token and keeps each token's state (what
               transformers' assisted generation does when it records the past): a rollback only
               picks one; memory 9 states a block while the pass is in flight.
  re-advance   the pass runs as transformers' plain forward does (the chunked rule for several
               tokens) and keeps its inputs; the state before it stays in the block's second slot
               (blocks/recurrent_state.py): a rollback re-advances that state over the accepted
               tokens' inputs, with the pass's own computation (bitwise what sending only those
               tokens gives); memory 2 states a block, plus the kept inputs.

Printed: medians of --repeats runs (milliseconds) of a plain one-token step, the pass of 9 tokens each
way, the rollback each way for 1..8 accepted tokens, the whole block's pass (projections included)
for scale, and the bytes a block keeps per session each way (float32 states, as transformers keeps
them; windows and inputs in --dtype).

    python benchmarks/recurrent_rollback.py
    python benchmarks/recurrent_rollback.py --repeats 50 --dtype bfloat16
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

from bloompeer.blocks.delta_rule import recurrent_gated_delta_rule  # noqa: E402
from bloompeer.blocks.gated_deltanet import DeltaNetSegment, GatedDeltaNet  # noqa: E402
from bloompeer.blocks.recurrent_state import MAX_ROLLBACK_TOKENS, RecurrentState  # noqa: E402

CONFIG = dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, num_hidden_layers=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"])
DRAFTS = 8
LINEAR_BLOCKS = 36  # Qwen3-Next-80B: 48 blocks, three of every four linear


def median_ms(run, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def keep_every_state(layer: GatedDeltaNet, inputs: torch.Tensor, start) -> list[torch.Tensor]:
    """The pass token by token with the recurrent rule, each token's state kept (the other way)."""
    states, window, state = [], start[0], start[1]
    for index in range(inputs.shape[1]):
        _, (window, state) = layer.mix(inputs[:, index:index + 1], (window, state))
        states.append(state)
    return states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    torch.manual_seed(0)
    layer = GatedDeltaNet(Qwen3NextConfig(**CONFIG), 0).to(device, dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0, 0.02)
    layout, linear = layer.layout, (lambda module, rows: module(rows))
    hidden = torch.randn(1, 64 + 1 + DRAFTS, CONFIG["hidden_size"], device=device, dtype=dtype)

    with torch.inference_mode():
        inputs, _ = layer.project(hidden, linear)
        _, start = layer.mix(inputs[:, :64], None)  # a state after a 64-token prompt
        step = inputs[:, 64:65]
        drafted = inputs[:, 64:]
        rows = [("plain step (recurrent, 1 token)", median_ms(lambda: layer.mix(step, start), args.repeats, device))]
        rows.append(("pass of 9, re-advance way (chunked)",
                     median_ms(lambda: layer.mix(drafted, start), args.repeats, device)))
        rows.append(("pass of 9, keep-states way (recurrent x 9)",
                     median_ms(lambda: keep_every_state(layer, drafted, start), args.repeats, device)))
        state = RecurrentState(layout, [0], 1, dtype, device)
        segment = [DeltaNetSegment(1, 1 + DRAFTS, state)]

        def whole_block_pass():
            state.begin_step(64, 1 + DRAFTS)
            layer.compute(hidden[:, 64:], linear, segment)

        state.begin_step(0, 64)
        layer.compute(hidden[:, :64], linear, [DeltaNetSegment(1, 64, state)])
        rows.append(("whole block's pass of 9 (projections, state kept)",
                     median_ms(whole_block_pass, args.repeats, device)))
        kept = keep_every_state(layer, drafted, start)
        slot = torch.empty_like(start[1])
        for accepted in range(1, 1 + DRAFTS):
            rows.append((f"rollback to {accepted} accepted, re-advance",
                         median_ms(lambda: layer.mix(drafted[:, :accepted], start), args.repeats, device)))
        rows.append(("rollback, keep-states (copy one state)",
                     median_ms(lambda: slot.copy_(kept[3]), args.repeats, device)))

    print(f"# one Gated DeltaNet block at Qwen3-Next's shapes, {args.dtype} on {device}, medians of {args.repeats}")
    for name, value in rows:
        print(f"{name:55s} {value:9.3f} ms")
    state_bytes = layout.heads * layout.key_dim * layout.value_dim * 4
    element = torch.empty((), dtype=dtype).element_size()
    window_bytes = layout.conv_dim * layout.conv_window * element
    keep_states = (1 + DRAFTS) * (state_bytes + window_bytes) + state_bytes + window_bytes
    readvance = layout.nbytes(1, dtype, MAX_ROLLBACK_TOKENS)
    print(f"{'one state matrix set (32 heads x 128 x 128, float32)':55s} {state_bytes / 2**20:9.2f} MiB")
    print(f"{'kept per block, keep-states way (1 + 9 states, windows)':55s} {keep_states / 2**20:9.2f} MiB")
    print(f"{f'kept per block, re-advance way (2 states, {MAX_ROLLBACK_TOKENS} inputs)':55s} "
          f"{readvance / 2**20:9.2f} MiB")
    print(f"{f'per session, {LINEAR_BLOCKS} linear blocks: keep-states / re-advance':55s} "
          f"{LINEAR_BLOCKS * keep_states / 2**20:6.0f} / {LINEAR_BLOCKS * readvance / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
