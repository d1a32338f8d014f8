"""Inference speed through a local swarm, next to transformers on the same weights in the same run.

For each model (random weights, written to a temp dir): starts a bootstrap peer and N servers on
127.0.0.1 splitting the blocks, then measures for bloompeer and for the model's own transformers
class (AutoModelForCausalLM) run locally:
  - decode: median time between consecutive tokens of greedy generate (16-token prompt, 32 new);
  - forward: seconds of one full forward over a 512-token prompt.
The runners take turns in each of --rounds rounds; the table shows each runner's median over the
rounds, their ratio, and the ratio within each round.
Decoding is measured with server-to-server push, without it, and with the default client (which
chooses per route from the round trips it measures). Prints a table with the ratios (bloompeer /
local; lower is better).

    python benchmarks/inference.py                      # tiny, bloom-560m and qwen3-0.6b architectures
    python benchmarks/inference.py --models tiny --servers 3
"""

from __future__ import annotations

import argparse
import contextlib
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
def bench(name: str, servers: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """{"decode"/"forward": {runner: one figure per round}}; runners take turns within each round, so
    that the machine's drift (10-30 % within an hour here) falls on all of them alike."""
    spec = MODELS[name]
    with tempfile.TemporaryDirectory(prefix=f"bloompeer-bench-{name}-") as tmp, contextlib.ExitStack() as stack:
        print(f"[{name}] writing a random checkpoint...", file=sys.stderr, flush=True)
        path = write_random_checkpoint(Path(tmp) / name, **spec)
        vocab = spec["vocab_size"]
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(4, vocab, (1, args.prompt_tokens), generator=generator)
        long_ids = torch.randint(4, vocab, (1, args.forward_tokens), generator=generator)
        runners = {"local": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()}
        print(f"[{name}] starting a swarm of {servers} servers...", file=sys.stderr, flush=True)
        swarm = stack.enter_context(LocalSwarm(path, split_blocks(spec["num_blocks"], servers)))
        for mode, push in MODES.items():
            config = ClientConfig(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True), push=push)
            runners[mode] = stack.enter_context(AutoDistributedModelForCausalLM.from_pretrained(path, client_config=config))
        for model in runners.values():
            decode_step_ms(model, prompt, 4, 1)  # warm-up: caches, route, connections
        results = {"decode": {runner: [] for runner in runners}, "forward": {"local": [], "push": []}}
        for round_index in range(args.rounds):
            print(f"[{name}] round {round_index + 1} of {args.rounds}...", file=sys.stderr, flush=True)
            for runner, model in runners.items():
                results["decode"][runner].append(decode_step_ms(model, prompt, args.new_tokens, 1))
            for runner in results["forward"]:
                results["forward"][runner].append(forward_s(runners[runner], long_ids, 1))
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--forward-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds; in each, every runner generates once and the forward runs once")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.servers} servers on 127.0.0.1; "
          f"{args.rounds} rounds")
    print(f"{'model':<12} {'metric':<30} {'local HF':>10} {'bloompeer':>10} {'ratio':>7}  ratio per round")
    for name in args.models:
        results = bench(name, args.servers, args)
        for metric, unit in (("decode", "ms"), ("forward", "s")):
            local = results[metric]["local"]
            for runner, figures in results[metric].items():
                if runner == "local":
                    continue
                label = f"decode step ({runner}), {unit}" if metric == "decode" else f"forward {args.forward_tokens} tokens, {unit}"
                per_round = " ".join(f"{ours / theirs:.2f}" for ours, theirs in zip(figures, local))
                print(f"{name:<12} {label:<30} {statistics.median(local):>10.3f} {statistics.median(figures):>10.3f} "
                      f"{statistics.median(figures) / statistics.median(local):>7.3f}  {per_round}", flush=True)


if __name__ == "__main__":
    main()
