"""How much a draft model speeds up decoding through the swarm, measured locally with transformers.

Speculative decoding: the draft proposes k tokens, the target checks them in one forward pass (one
step through the swarm), keeps the ones that match its own greedy choice, and adds one of its own.
Through the swarm a verify pass costs about one decode step (the network dominates: ~300 ms a step
at 50 ms one way with 3 servers, ~200 ms with push), so the tokens gained per verify pass are the
speed-up, less the draft's own compute, which runs on the client between passes:

    gain ~= tokens per verify pass * step / (step + draft time per pass)

`acceptance()` measures those terms on one machine, with transformers only (target and draft are
BloomForCausalLM); benchmarks/wan.py can import it. The command prints them for several k on
prompts from the demo model's held-out text, next to plain greedy decoding (1 token per pass, the
baseline) measured in the same run, and checks that assisted greedy gives plain greedy's tokens.

    nice -n 10 python benchmarks/draft_acceptance.py                 # the bundled draft, k = 2..12
    python benchmarks/draft_acceptance.py --draft target --num-assistant-tokens 6   # the ceiling
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from pathlib import Path

import torch

from bloompeer.peer.cli.default_model import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR

__all__ = ["acceptance", "estimated_gain", "heldout_prompts"]


def heldout_prompts(tokenizer, count: int, prompt_tokens: int, text_path: Path = DEMO_MODEL_DIR / "heldout.txt"):
    """`count` prompts of `prompt_tokens` tokens, cut at evenly spaced offsets of the held-out text."""
    ids = tokenizer(text_path.read_text(encoding="utf-8"))["input_ids"]
    stride = max(1, (len(ids) - prompt_tokens) // max(1, count))
    return [torch.tensor([ids[start:start + prompt_tokens]]) for start in range(0, stride * count, stride)]


@contextlib.contextmanager
def _assistant_settings(draft, num_assistant_tokens: int | None, schedule: str | None, threshold: float | None):
    """Temporarily set the draft's assisted-generation settings (transformers reads them from the draft's
    generation_config, and the heuristic schedule and the confidence threshold write back into it)."""
    config = draft.generation_config
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    saved = {name: getattr(config, name) for name in names}
    for name, value in zip(names, (num_assistant_tokens, schedule, threshold)):
        if value is not None:
            setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


@contextlib.contextmanager
def _counting(target, draft, counts: dict):
    """Count the target's forward passes, and the draft's proposals and the time spent making them."""
    def on_target_forward(module, args):
        counts["passes"] += 1

    draft_generate = draft.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = draft_generate(*args, **kwargs)
        counts["draft_s"] += time.perf_counter() - start
        prompt = kwargs.get("input_ids", args[0] if args else None)
        counts["proposed"] += out.sequences.shape[1] - prompt.shape[1]
        return out

    hook = target.register_forward_pre_hook(on_target_forward)
    draft.generate = timed_generate  # the instance attribute shadows the method, for this block only
    try:
        yield
    finally:
        hook.remove()
        del draft.generate


def acceptance(target, draft, prompts, max_new_tokens: int, num_assistant_tokens: int | None,
               schedule: str | None = None, confidence_threshold: float | None = None) -> dict:
    """Greedy assisted generation of `max_new_tokens` from each prompt, against plain greedy.

    draft must be another object than target (for the target as its own draft, pass a deep copy).
    num_assistant_tokens / schedule / confidence_threshold: override the draft's generation_config (None:
    as it is; transformers' default threshold, 0.4, stops a proposal where the draft's top probability
    falls below it, which the bundled draft turns off: a longer verify pass costs little over a network).
    Returns: acceptance (accepted draft tokens / proposed), tokens_per_pass (new tokens / target
    forward passes, the prefill's included, as in the swarm), draft_ms_per_pass, plain_ms_per_token and
    assisted_ms_per_token (local, this machine), exact (prompts whose assisted tokens equal plain
    greedy's), and the raw counts."""
    if draft is target:
        raise ValueError("pass a copy of the target as its own draft (copy.deepcopy), so its passes can be told apart")
    counts = {"passes": 0, "proposed": 0, "accepted": 0, "draft_s": 0.0}
    new_tokens = exact = plain_passes = 0
    plain_s = assisted_s = 0.0
    with torch.inference_mode(), _assistant_settings(draft, num_assistant_tokens, schedule, confidence_threshold):
        for prompt in prompts:
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=target.config.pad_token_id)
            start = time.perf_counter()
            plain = target.generate(prompt, **kwargs)
            plain_s += time.perf_counter() - start
            plain_passes += plain.shape[1] - prompt.shape[1]
            passes_before = counts["passes"]
            with _counting(target, draft, counts):
                start = time.perf_counter()
                assisted = target.generate(prompt, assistant_model=draft, **kwargs)
                assisted_s += time.perf_counter() - start
            generated = assisted.shape[1] - prompt.shape[1]
            new_tokens += generated
            exact += int(torch.equal(plain, assisted))
            counts["accepted"] += generated - (counts["passes"] - passes_before)  # each pass adds accepted + 1
    passes = counts["passes"]
    return {
        "acceptance": counts["accepted"] / counts["proposed"] if counts["proposed"] else 0.0,
        "tokens_per_pass": new_tokens / passes,
        "draft_ms_per_pass": 1000 * counts["draft_s"] / passes,
        "plain_ms_per_token": 1000 * plain_s / plain_passes,
        "assisted_ms_per_token": 1000 * assisted_s / new_tokens,
        "exact": exact, "prompts": len(prompts), "new_tokens": new_tokens, "passes": passes,
        "proposed": counts["proposed"], "accepted": counts["accepted"],
    }


def estimated_gain(result: dict, step_ms: float) -> float:
    """Tokens/s through the swarm relative to plain decoding, when a verify pass costs one decode step of
    `step_ms` (network-bound: a pass of k+1 tokens costs about what a pass of one does)."""
    return result["tokens_per_pass"] * step_ms / (step_ms + result["draft_ms_per_pass"])


def main(argv=None) -> None:
    from transformers import AutoTokenizer, BloomForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--draft", default=str(DEMO_DRAFT_MODEL_DIR),
                        help="draft checkpoint directory, or 'target' for the target as its own draft")
    parser.add_argument("--prompts", type=int, default=8, help="prompts cut from heldout.txt")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-assistant-tokens", type=int, nargs="+", default=[2, 4, 6, 8, 12],
                        help="values of k to try, with the constant schedule")
    parser.add_argument("--heuristic", action="store_true",
                        help="also try transformers' heuristic schedule (k grows by 2 after a full accept, else -1)")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[300.0, 200.0],
                        help="cost of one decode step through the swarm (50 ms one way, 3 servers: ~300 without "
                             "push, ~200 with)")
    parser.add_argument("--confidence-threshold", type=float, default=0.0,
                        help="assistant_confidence_threshold for every run (the bundled draft's: 0, off)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = BloomForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    if args.draft == "target":  # a copy: the counting hooks must tell the target's passes from the draft's
        draft = copy.deepcopy(target)
    else:
        draft = BloomForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_tokens)
    shipped = draft.generation_config
    print(f"target {args.target} ({sum(p.numel() for p in target.parameters()):,} parameters), draft {args.draft} "
          f"({sum(p.numel() for p in draft.parameters()):,}; shipped setting: k={shipped.num_assistant_tokens}, "
          f"{shipped.num_assistant_tokens_schedule}, confidence threshold {shipped.assistant_confidence_threshold}); "
          f"runs with confidence threshold {args.confidence_threshold}; {len(prompts)} prompts of {args.prompt_tokens} tokens from "
          f"heldout.txt, {args.max_new_tokens} new tokens each, greedy, {args.threads} thread(s)")

    runs = [(f"k={k}", k, "constant") for k in args.num_assistant_tokens]
    if args.heuristic:
        runs += [(f"k={k}+heur", k, "heuristic") for k in args.num_assistant_tokens[:1]]
    gains = " ".join(f"{f'gain@{s:g}ms':>11}" for s in args.step_ms)
    print(f"{'':12} {'accept':>7} {'tok/pass':>9} {'draft ms':>9} {'local ms/tok':>13} {'exact':>6} {gains}")
    baseline = None
    for label, k, schedule in runs:
        result = acceptance(target, draft, prompts, args.max_new_tokens, k, schedule, args.confidence_threshold)
        if baseline is None:  # plain greedy, timed in the same calls
            baseline = result["plain_ms_per_token"]
            print(f"{'plain greedy':12} {'-':>7} {1.0:9.2f} {0.0:9.2f} {baseline:13.1f} {'-':>6} "
                  + " ".join(f"{1.0:11.2f}" for _ in args.step_ms))
        print(f"{label:12} {result['acceptance']:7.3f} {result['tokens_per_pass']:9.2f} "
              f"{result['draft_ms_per_pass']:9.2f} {result['assisted_ms_per_token']:13.1f} "
              f"{result['exact']:>3}/{result['prompts']:<2} "
              + " ".join(f"{estimated_gain(result, s):11.2f}" for s in args.step_ms))
    print("gain: estimated tokens/s through the swarm relative to plain decoding at that step cost "
          "(= tok/pass * step / (step + draft ms)); local ms/tok: this machine, both models local")


if __name__ == "__main__":
    main()
