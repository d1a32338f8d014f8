"""Inference speed through a local swarm, next to transformers on the same weights in the same run.

For each model (random weights, written to a temp dir): starts a bootstrap peer and N servers on
127.0.0.1 splitting the blocks, then measures for bloompeer and for the model's own transformers
class (AutoModelForCausalLM) run locally:
  - decode: median time between consecutive tokens of greedy generate (16-token prompt, 32 new);
  - forward: median seconds of one full forward over a 512-token prompt.
Decoding is measured with server-to-server push, without it, and with the default client (which
chooses per route from the round trips it measures). Prints a table with the ratios (bloompeer /
local; lower is better).

    python benchmarks/inference.py                      # tiny, bloom-560m and qwen3-0.6b architectures
    python benchmarks/inference.py --models tiny --servers 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from bloompeer import AutoDistributedModelForCausalLM, ClientConfig, NetworkConfig
from bloompeer.peer.cli.default_model import write_random_checkpoint
from bloompeer.peer.cli.local_swarm import LocalSwarm, split_blocks

MODELS = {  # name -> write_random_checkpoint arguments
    "tiny": dict(num_blocks=4, hidden_size=64, num_heads=4, vocab_size=260),
    "bloom-560m": dict(num_blocks=24, hidden_size=1024, num_heads=16, vocab_size=250880, max_shard_size="1GB"),
    "qwen3-0.6b": dict(model_type="qwen3", num_blocks=28, hidden_size=1024, num_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                       max_shard_size="1GB"),
}


MODES = {"push": True, "no push": False, "default": None}  # ClientConfig.push


class _TokenClock(LogitsProcessor):
    """Records when each new token's logits are ready (called once per generated token)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def decode_step_ms(model, prompt: torch.Tensor, new_tokens: int, repeats: int) -> float:
    """Median time between consecutive tokens (the prefill's first token excluded)."""
    gaps = []
    for _ in range(repeats):
        clock = _TokenClock()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
        gaps += [b - a for a, b in zip(clock.times, clock.times[1:])]
    return 1000 * statistics.median(gaps)


def forward_s(model, ids: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def bench(name: str, servers: int, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    spec = MODELS[name]
    with tempfile.TemporaryDirectory(prefix=f"bloompeer-bench-{name}-") as tmp:
        print(f"[{name}] writing a random checkpoint...", file=sys.stderr, flush=True)
        path = write_random_checkpoint(Path(tmp) / name, **spec)
        vocab = spec["vocab_size"]
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(4, vocab, (1, args.prompt_tokens), generator=generator)
        long_ids = torch.randint(4, vocab, (1, args.forward_tokens), generator=generator)
        results = {}
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        decode_step_ms(local, prompt, 4, 1)  # warm-up
        results["local"] = (decode_step_ms(local, prompt, args.new_tokens, args.repeats),
                            forward_s(local, long_ids, args.forward_repeats))
        del local
        print(f"[{name}] starting a swarm of {servers} servers...", file=sys.stderr, flush=True)
        with LocalSwarm(path, split_blocks(spec["num_blocks"], servers)) as swarm:
            for mode, push in MODES.items():
                config = ClientConfig(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True),
                                      push=push)
                with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=config) as model:
                    decode_step_ms(model, prompt, 4, 1)  # warm-up: route, connections
                    decode = decode_step_ms(model, prompt, args.new_tokens, args.repeats)
                    forward = forward_s(model, long_ids, args.forward_repeats) if push else None
                results[mode] = (decode, forward)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--forward-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="generate calls per decode measurement")
    parser.add_argument("--forward-repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.servers} servers on 127.0.0.1")
    print(f"{'model':<12} {'metric':<28} {'local HF':>10} {'bloompeer':>10} {'ratio':>7}")
    for name in args.models:
        results = bench(name, args.servers, args)
        local_decode, local_forward = results["local"]
        for mode in MODES:
            decode = results[mode][0]
            print(f"{name:<12} {f'decode step ({mode}), median ms':<28} {local_decode:>10.2f} {decode:>10.2f} "
                  f"{decode / local_decode:>7.3f}")
        forward = results["push"][1]
        print(f"{name:<12} {f'forward {args.forward_tokens} tokens, s':<28} {local_forward:>10.3f} "
              f"{forward:>10.3f} {forward / local_forward:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
