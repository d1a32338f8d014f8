"""Constrained decoding's cost: the two grammar libraries on our tokenizers, and the mask beside a
decode step through a local swarm.

Part 1, the libraries (issue 41 chose between them with this). For xgrammar and llguidance, on the
demo model's tokenizer (byte-level BPE, 4096 tokens) and the tests' byte tokenizer (259 tokens):
  - tokenizer: seconds to read the tokenizer into the library (once per `bloompeer api`);
  - compile: seconds to compile `json_object` (any JSON) and a schema (once per request);
  - mask: microseconds per generated token to compute the allowed-token mask, apply it to a row of
    logits and advance the matcher by the token, following the tokens of a valid reply.
Part 2, the mask beside the step: bloompeer's own processor (bloompeer/peer/api/constrained.py)
in generate() through a local swarm of the demo model (2 servers on 127.0.0.1), the median time
between tokens with and without it, runs taking turns.

    PYTHONPATH=. python benchmarks/constrained_decoding.py              # both parts
    PYTHONPATH=. python benchmarks/constrained_decoding.py --no-swarm   # the libraries only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy
import torch
from transformers import AutoTokenizer, LogitsProcessor

from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR, write_byte_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["swarm", "peer", "block"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
REPLY = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["swarm", "peer", "block"],
         "address": {"city": "London", "zip": "W1"}}


class _Library:
    """One grammar library as the table measures it: read the tokenizer, compile, and per token of a
    reply, fill the mask, apply it, accept the token."""

    def masks_us(self, grammar, token_ids: list[int]) -> list[tuple[float, float]]:
        """(matcher us, apply us) for each token: the mask filled and the token accepted; the mask applied."""
        step, times = self.start(grammar), []
        for token in token_ids:
            start = time.perf_counter()
            step.fill()
            filled = time.perf_counter()
            step.apply()
            applied = time.perf_counter()
            if not step.accept(token):
                raise RuntimeError(f"{type(self).__name__} refused token {token}")
            times.append((1e6 * (time.perf_counter() - applied + filled - start), 1e6 * (applied - filled)))
        return times


class _Xgrammar(_Library):
    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr, self.vocab_size = xgr, vocab_size
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.tokenizer_s = time.perf_counter() - start

    def compile(self, schema: dict | None):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_builtin_json_grammar() if schema is None else compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def start(self, grammar):
        xgr, matcher = self.xgr, self.xgr.GrammarMatcher(grammar)
        bitmask, logits = xgr.allocate_token_bitmask(1, self.vocab_size), torch.zeros(1, self.vocab_size)
        return SimpleNamespace(fill=lambda: matcher.fill_next_token_bitmask(bitmask),
                               apply=lambda: xgr.apply_token_bitmask_inplace(logits, bitmask),
                               accept=matcher.accept_token)


class _Llguidance(_Library):
    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llguidance, self.vocab_size = llguidance, vocab_size
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.tokenizer_s = time.perf_counter() - start

    def compile(self, schema: dict | None):
        grammar = self.llguidance.LLMatcher.grammar_from_json_schema(schema or {"type": "object"},
                                                                     defaults={"whitespace_flexible": False})
        matcher = self.llguidance.LLMatcher(self.tokenizer, grammar)  # where llguidance compiles
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def start(self, grammar):
        masks, matcher = self.llguidance.numpy, self.llguidance.LLMatcher(self.tokenizer, grammar)
        bitmask = masks.allocate_token_bitmask(1, self.vocab_size)
        logits = numpy.zeros((1, self.vocab_size), dtype=numpy.float32)
        return SimpleNamespace(fill=lambda: masks.fill_next_token_bitmask(matcher, bitmask, 0),
                               apply=lambda: masks.apply_token_bitmask_inplace(logits, bitmask),
                               accept=matcher.consume_token)


LIBRARIES = {"xgrammar": _Xgrammar, "llguidance": _Llguidance}


def _percentile(values: list[float], fraction: float) -> float:
    return sorted(values)[int(fraction * (len(values) - 1))]


def bench_libraries(tokenizers: dict[str, object], repeats: int) -> None:
    """One row per tokenizer and library; medians over `repeats` runs."""
    print(f"{'tokenizer':<24} {'library':<11} {'load s':>7} {'compile ms: json_object':>23} {'schema':>7}  "
          f"{'us/token: matcher (median, p90)':>31} {'apply':>6}")
    for tokenizer_name, tokenizer in tokenizers.items():
        vocab_size = len(tokenizer)
        reply_ids = tokenizer(json.dumps(REPLY, separators=(",", ":")), add_special_tokens=False).input_ids
        reply_ids.append(tokenizer.eos_token_id)
        for library, library_class in LIBRARIES.items():
            measured = library_class(tokenizer, vocab_size)
            compile_ms, grammars = {}, {}
            for label, schema in (("json_object", None), ("schema", SCHEMA)):
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    grammars[label] = measured.compile(schema)
                    times.append(1000 * (time.perf_counter() - start))
                compile_ms[label] = statistics.median(times)
            per_token = [times for _ in range(repeats) for times in measured.masks_us(grammars["schema"], reply_ids)]
            matcher_us, apply_us = [t[0] for t in per_token], [t[1] for t in per_token]
            print(f"{tokenizer_name + f' [{len(reply_ids)}]':<24} {library:<11} {measured.tokenizer_s:>7.3f} "
                  f"{compile_ms['json_object']:>23.2f} "
                  f"{compile_ms['schema']:>7.2f}  {statistics.median(matcher_us):>23.1f}, "
                  f"{_percentile(matcher_us, 0.9):>6.1f} {statistics.median(apply_us):>6.1f}", flush=True)
    print("(per run, the tokens of a valid reply to the schema [in brackets]; matcher: the allowed tokens computed "
          "and the token accepted; apply: the mask set on a row of float32 logits)")


def large_tokenizer(directory: Path):
    """A byte-level BPE with a real checkpoint's vocabulary size (32k-152k), trained here on transformers'
    own source files (tests and benchmarks never download): 76,543 tokens, 12 s on 2 cores."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(str(path) for path in Path(transformers.__file__).parent.rglob("*.py"))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train(files, trainers.BpeTrainer(vocab_size=131072, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


STEP_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 400}}, "required": ["text"]}
STEP_PROMPT = 'Reply as JSON. It is a truth universally acknowledged, that a single man in possession of a good fortune'


class _TokenClock(LogitsProcessor):
    """Records when each new token's logits are ready (called once per generated token), and how long the
    processors after it took."""

    def __init__(self, inner: LogitsProcessor | None):
        self.inner, self.times, self.inner_s = inner, [], []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if self.inner is None:
            return scores
        start = time.perf_counter()
        scores = self.inner(input_ids, scores)
        self.inner_s.append(time.perf_counter() - start)
        return scores


def bench_step(rounds: int, new_tokens: int) -> None:
    """The demo model through 2 servers on 127.0.0.1, greedy, with bloompeer's processor (a string of
    up to 400 characters to fill, so that every run decodes new_tokens) and without it."""
    from bloompeer import AutoDistributedModelForCausalLM, ClientConfig, NetworkConfig
    from bloompeer.peer.api.constrained import GrammarCompiler
    from bloompeer.peer.cli.local_swarm import LocalSwarm, split_blocks

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    grammar = compiler.json_schema(STEP_SCHEMA)
    prompt = torch.tensor([tokenizer(STEP_PROMPT).input_ids])
    print("starting a local swarm of the demo model (2 servers)...", file=sys.stderr, flush=True)
    with LocalSwarm(str(DEMO_MODEL_DIR), split_blocks(6, 2)) as swarm, torch.inference_mode():
        config = ClientConfig(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True))
        with AutoDistributedModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, client_config=config) as model:
            def run(constrained: bool) -> _TokenClock:
                clock = _TokenClock(grammar.processor(prompt.shape[1]) if constrained else None)
                model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, logits_processor=[clock],
                               pad_token_id=0)
                return clock

            run(False), run(True)  # warm-up: route, connections, caches
            steps_ms = {False: [], True: []}
            mask_us = []
            for _ in range(rounds):
                for constrained in (False, True):
                    clock = run(constrained)
                    steps_ms[constrained] += [1000 * (b - a) for a, b in zip(clock.times, clock.times[1:])]
                    mask_us += [1e6 * t for t in clock.inner_s]
    free, masked = statistics.median(steps_ms[False]), statistics.median(steps_ms[True])
    mask = statistics.median(mask_us)
    print(f"\ndemo model through 2 servers, greedy, {new_tokens} tokens x {rounds} rounds:")
    print(f"  decode step, free text         {free:8.2f} ms")
    print(f"  decode step, under the schema  {masked:8.2f} ms  ({masked / free:.3f}x)")
    print(f"  the mask itself (median, p90)  {mask / 1000:8.3f} ms, {_percentile(mask_us, 0.9) / 1000:.3f} ms  "
          f"({mask / 1000 / free:.1%} of the free step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-large", action="store_true", help="skip the 76k-token tokenizer (12 s to train)")
    parser.add_argument("--no-swarm", action="store_true", help="measure the libraries only")
    parser.add_argument("--rounds", type=int, default=5, help="swarm runs with and without the mask, taking turns")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        write_byte_tokenizer(Path(tmp) / "bytes")
        tokenizers = {"demo model (4,096)": AutoTokenizer.from_pretrained(DEMO_MODEL_DIR),
                      "tests' bytes (259)": AutoTokenizer.from_pretrained(Path(tmp) / "bytes")}
        if not args.no_large:
            print("training a 76k-token BPE...", file=sys.stderr, flush=True)
            tokenizers["BPE of 76,543"] = large_tokenizer(Path(tmp) / "large")
        bench_libraries(tokenizers, args.repeats)
    if not args.no_swarm:
        bench_step(args.rounds, args.new_tokens)


if __name__ == "__main__":
    main()
