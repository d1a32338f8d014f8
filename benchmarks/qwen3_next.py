"""Qwen3-Next's blocks (Gated DeltaNet beside gated attention, shared-expert MoE) through a local swarm, next
to transformers' Qwen3NextForCausalLM on the same weights in the same run.

Qwen3-Next's block shapes (hidden 2048; attention: 16 query heads, 2 KV heads of 256, partial rotary;
Gated DeltaNet: 16 key heads and 32 value heads of 128, conv kernel 4; 64 experts of 512, 10 a token, a
shared expert of 512), --blocks blocks whose layer_types follow the real pattern (3 linear_attention, then
1 full_attention), random weights, float32, a 512-word vocabulary (only blocks are measured), 2 CLI servers
splitting the blocks. For each session length L (1024 and 8192 tokens: a prompt of L - ROOM tokens, then
the timed steps, all within max_length L):
  1. decode: one-token steps of the model in a kept inference session (`model(ids)`), after its prefill,
     against transformers' own one-token forwards with its DynamicCache after the same prefill; the two
     take turns in each of --rounds rounds of --steps steps (median per round), each feeding back its
     own greedy token (the tokens are compared);
  2. a session's cache on the servers: the tensors a SessionCache of max_length L allocates (built on the
     meta device by each server's span: the Gated DeltaNet blocks' states, windows and kept inputs, and
     the attention blocks' keys and values), the servers' own reservation (their cache_bytes_used gauge,
     scraped while the decode session is open) and the bytes expected from the shapes, beside
     transformers' cache after its prefill;
  3. a speculative step: a verify pass of 1 + 8 drafts against a plain one-token step through the swarm,
     and the one-token step that follows a partial rejection (3 drafts accepted: each Gated DeltaNet
     block re-advances its state over the 4 accepted tokens first); beside transformers' own pass of 9
     on a copy of its cache.

    python benchmarks/qwen3_next.py                     # 4 blocks on 2 servers, 3 rounds
    python benchmarks/qwen3_next.py --blocks 8 --rounds 5
    python benchmarks/qwen3_next.py --lengths 1024     # the 1k session alone, 4 minutes
    python benchmarks/qwen3_next.py --tiny              # toy sizes, seconds (tests/swarm/test_qwen3_next_bench.py)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.moe import client_config, row  # noqa: E402
from bloompeer import AutoDistributedModelForCausalLM  # noqa: E402
from bloompeer.blocks import open_checkpoint  # noqa: E402
from bloompeer.blocks.recurrent_state import MAX_ROLLBACK_TOKENS  # noqa: E402
from bloompeer.peer.cli.default_model import write_random_checkpoint  # noqa: E402
from bloompeer.peer.cli.local_swarm import LocalSwarm, split_blocks, stop_in_parallel  # noqa: E402

SHAPE = dict(model_type="qwen3_next", hidden_size=2048, num_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512,
             shared_expert_intermediate_size=512, norm_topk_prob=True, vocab_size=512, max_shard_size="2GB")
TINY = SHAPE | dict(hidden_size=64, num_heads=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=32, max_shard_size="5MB")
LENGTHS, TINY_LENGTHS = (1024, 8192), (48, 160)  # session lengths; the tiny prompts are shorter and longer than 64
DRAFTS, ACCEPTED = 8, 3
GOALS = {"decode vs transformers": 1.10}


@dataclass
class Figures:
    """One session length's measurements; times in ms, one per round."""

    ours: list[float] = dataclasses.field(default_factory=list)
    local: list[float] = dataclasses.field(default_factory=list)
    plain: list[float] = dataclasses.field(default_factory=list)  # speculative part: one-token step through the swarm
    verify: list[float] = dataclasses.field(default_factory=list)  # a pass of 1 + DRAFTS
    after_rejection: list[float] = dataclasses.field(default_factory=list)  # the step after ACCEPTED were accepted
    local_verify: list[float] = dataclasses.field(default_factory=list)
    tokens_equal: bool = True
    cache: dict[str, int] = dataclasses.field(default_factory=dict)  # SessionCache tensors: "deltanet", "attention"
    gauge: int = 0  # the servers' cache_bytes_used, summed
    local_cache: dict[str, int] = dataclasses.field(default_factory=dict)


def room(args) -> int:
    """Tokens a session keeps free after its prompt: the decode steps, then per round a plain step, a verify
    pass (rolled back to ACCEPTED drafts) and the step after it."""
    return args.rounds * args.steps + args.rounds * (2 + ACCEPTED + 1) + DRAFTS + 1


def expected_bytes(config, start: int, end: int, max_length: int) -> dict[str, int]:
    """What blocks [start, end) should reserve for a float32 session of one row, from the shapes alone: per
    Gated DeltaNet block two (state, window) slots and the inputs of a pass of up to MAX_ROLLBACK_TOKENS (to
    roll back into); per attention block a key and a value per KV head and token; one mask byte a token."""
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * config.linear_num_key_heads * key_dim + config.linear_num_value_heads * value_dim
    state = config.linear_num_value_heads * key_dim * value_dim * 4
    window = conv_dim * (config.linear_conv_kernel_dim - 1) * 4
    inputs = MAX_ROLLBACK_TOKENS * (conv_dim + 2 * config.linear_num_value_heads) * 4
    kinds = config.layer_types[start:end]
    per_token = 2 * config.num_key_value_heads * config.head_dim * 4
    return {"deltanet": kinds.count("linear_attention") * (2 * state + 2 * window + inputs),
            "attention": kinds.count("full_attention") * per_token * max_length + max_length}


def expected_total(path: Path, placement, length: int) -> dict[str, int]:
    """expected_bytes over every server of `placement`."""
    config, totals = open_checkpoint(path).config(), {"deltanet": 0, "attention": 0}
    for start, end in placement:
        for kind, nbytes in expected_bytes(config, start, end, length).items():
            totals[kind] += nbytes
    return totals


def session_cache_bytes(path: Path, placement, max_length: int) -> dict[str, int]:
    """The tensors each server's span allocates for a session of max_length (on the meta device), summed."""
    checkpoint = open_checkpoint(path)
    totals = {"deltanet": 0, "attention": 0}
    for start, end in placement:
        with torch.device("meta"):
            span = checkpoint.family.span_class(checkpoint.config(), start, end)
            cache = span.new_cache(start, end, 1, max_length, torch.float32, "meta")
        if cache.recurrent is not None:
            totals["deltanet"] += sum(tensor.nbytes for block in cache.recurrent._blocks.values()
                                      for tensor in (block.states, block.windows, block.inputs))
        totals["attention"] += sum(t.nbytes for stack in cache._stacks for t in stack) + cache.padding_mask.nbytes
    return totals


def local_cache_bytes(cache) -> dict[str, int]:
    """transformers' DynamicCache: its linear-attention layers' conv and recurrent states, its keys and values."""
    totals = {"deltanet": 0, "attention": 0}
    for layer in cache.layers:
        kind = "deltanet" if hasattr(layer, "recurrent_states") else "attention"
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            totals[kind] += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    return totals


def gauge_bytes(urls: list[str]) -> int:
    total = 0
    for url in urls:
        with urllib.request.urlopen(url, timeout=30) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("bloompeer_server_cache_bytes_used "):
                    total += int(float(line.split()[1]))
    return total


def timed(call) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    logits = call()
    return 1000 * (time.perf_counter() - started), logits


def measure(ours, local, session, prompt: torch.Tensor, urls: list[str], args) -> Figures:
    """Parts 1 to 3 on a session of ours (kept, opened for the prompt and room(args)) and on local."""
    figures = Figures()
    ours_next = ours(prompt).logits[:, -1:].argmax(-1)  # prefills
    figures.gauge = gauge_bytes(urls)
    output = local(prompt, use_cache=True)
    cache, local_next = output.cache, output.logits[:, -1:].argmax(-1)
    figures.local_cache = local_cache_bytes(cache)
    for round_index in range(args.rounds):
        ours_ms, local_ms, ours_tokens, local_tokens = [], [], [ours_next], [local_next]
        for _ in range(args.steps):
            ms, logits = timed(lambda: ours(ours_next).logits)
            ours_ms.append(ms)
            ours_next = logits[:, -1:].argmax(-1)
            ours_tokens.append(ours_next)
        for _ in range(args.steps):
            ms, logits = timed(lambda: local(local_next, cache=cache, use_cache=True).logits)
            local_ms.append(ms)
            local_next = logits[:, -1:].argmax(-1)
            local_tokens.append(local_next)
        figures.tokens_equal &= torch.equal(torch.cat(ours_tokens, 1), torch.cat(local_tokens, 1))
        figures.ours.append(statistics.median(ours_ms))
        figures.local.append(statistics.median(local_ms))
        print(f"  round {round_index + 1}: decode bloompeer {figures.ours[-1]:.1f} ms, "
              f"transformers {figures.local[-1]:.1f} ms", file=sys.stderr, flush=True)
    drafts = torch.randint(4, local.config.vocab_size, (1, DRAFTS), generator=torch.Generator().manual_seed(1))
    for _ in range(args.rounds):
        ms, logits = timed(lambda: ours(ours_next).logits)
        figures.plain.append(ms)
        position = session.position
        ms, _ = timed(lambda: ours(torch.cat([logits[:, -1:].argmax(-1), drafts], 1)).logits)
        figures.verify.append(ms)
        session.rewind(position + 1 + ACCEPTED)  # the token and 3 drafts accepted, the other 5 rejected
        ms, logits = timed(lambda: ours(drafts[:, ACCEPTED:ACCEPTED + 1]).logits)
        figures.after_rejection.append(ms)
        ours_next = logits[:, -1:].argmax(-1)
        scratch = copy.deepcopy(cache)  # transformers cannot roll its recurrent state back: the pass runs on a copy
        ms, _ = timed(lambda: local(torch.cat([local_next, drafts], 1), cache=scratch, use_cache=True).logits)
        figures.local_verify.append(ms)
    return figures


def run(swarm, path: Path, placement, lengths, args) -> dict[int, Figures]:
    """Every part, for each session length, on servers of `placement` added to `swarm` (stopped after)."""
    flags = ["--max-length", str(max(lengths)), "--cache-tokens", str(max(lengths)), "--metrics-port", "0",
             "--session-timeout", "3600",  # the session waits while transformers prefills 8k tokens
             "--quick-throughput"]  # measured in a few steps: with one server per span, no route depends on it
    servers = [swarm.add_server(start, end, model=path, extra_args=flags, wait=False, name=f"{path.name}-{start}")
               for start, end in placement]
    try:
        deadline = time.monotonic() + 300
        for server in servers:
            server.wait_online(deadline)
        urls = [next(line for line in server.stdout if line.startswith("metrics: ")).split(" ", 1)[1]
                for server in servers]
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = dataclasses.replace(client_config(swarm), request_timeout_s=1800.0)
        results = {}
        with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=config) as ours:
            for length in lengths:
                print(f"session of {length} tokens...", file=sys.stderr, flush=True)
                prompt = torch.randint(4, local.config.vocab_size, (1, length - room(args)),
                                       generator=torch.Generator().manual_seed(0))
                with ours.inference_session(max_length=length) as session:
                    results[length] = measure(ours, local, session, prompt, urls, args)
                results[length].cache = session_cache_bytes(path, placement, length)
        return results
    finally:
        stop_in_parallel(servers)


def decode_rows(results: dict[int, Figures]) -> list[str]:
    rows = []
    for length, figures in results.items():
        rows.append(row(f"decode step, session of {length}", figures.ours, figures.local,
                        f"<= {GOALS['decode vs transformers']}"))
    return rows


def memory_rows(results: dict[int, Figures], path: Path, placement) -> list[str]:
    """A session's cache on the servers, in MiB: the SessionCache's tensors by kind, the servers' gauge, the
    bytes expected from the shapes, and transformers' cache after the same prompt."""
    mib, lines = 2**20, []
    for length, figures in results.items():
        expected = expected_total(path, placement, length)
        for kind, label in (("deltanet", "Gated DeltaNet blocks"), ("attention", "attention blocks + mask")):
            lines.append(f"{f'{label}, session of {length}':<44} {figures.cache[kind] / mib:>10.3f} "
                         f"{expected[kind] / mib:>10.3f} {'':>10} {figures.local_cache[kind] / mib:>12.3f}")
        lines.append(f"{f'both servers, session of {length}':<44} {sum(figures.cache.values()) / mib:>10.3f} "
                     f"{sum(expected.values()) / mib:>10.3f} {figures.gauge / mib:>10.3f} "
                     f"{sum(figures.local_cache.values()) / mib:>12.3f}")
    return lines


def speculative_rows(results: dict[int, Figures]) -> list[str]:
    rows = []
    for length, figures in results.items():
        rows.append(row(f"verify pass of 1 + {DRAFTS} vs plain step, {length}", figures.verify, figures.plain, ""))
        rows.append(row(f"step after {DRAFTS - ACCEPTED} rejected vs plain, {length}", figures.after_rejection,
                        figures.plain, ""))
        rows.append(row(f"verify pass of 9 vs transformers' pass, {length}", figures.verify, figures.local_verify,
                        ""))
    return rows


def print_tables(results: dict[int, Figures], path: Path, placement) -> None:
    print(f"\n{'':<44} {'bloompeer':>10} {'baseline':>10} {'unit':<6} {'ratio':>6} {'goal':<8} per round")
    for line in decode_rows(results) + speculative_rows(results):
        print(line)
    print(f"\n{'session cache, MiB':<44} {'SessionCache':>10} {'expected':>10} {'gauge':>10} {'transformers':>12}")
    for line in memory_rows(results, path, placement):
        print(line)
    for length, figures in results.items():
        print(f"session of {length}: greedy tokens equal transformers': {figures.tokens_equal}; decode ms per "
              f"round: bloompeer {' '.join(f'{v:.1f}' for v in figures.ours)}; transformers "
              f"{' '.join(f'{v:.1f}' for v in figures.local)}")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4, help="blocks of the model, a multiple of 4 (default 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed one-token steps per runner and round")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="session lengths (default 1024 8192)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (hidden 64, sessions of 48 and 160)")
    args = parser.parse_args()
    shape, lengths = (TINY, TINY_LENGTHS) if args.tiny else (SHAPE, LENGTHS)
    lengths = args.lengths or lengths
    placement = split_blocks(args.blocks, 2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Qwen3-Next's block shapes"
          f"{' (tiny)' if args.tiny else ''}, {args.blocks} blocks, servers {placement}; {args.rounds} rounds of "
          f"{args.steps} steps", flush=True)
    with tempfile.TemporaryDirectory(prefix="bloompeer-qwen3-next-") as tmp:
        print("writing the random checkpoint...", file=sys.stderr, flush=True)
        path = write_random_checkpoint(Path(tmp) / "qwen3-next", num_blocks=args.blocks, **shape)
        with LocalSwarm(path, []) as swarm:
            results = run(swarm, path, placement, lengths, args)
        print_tables(results, path, placement)


if __name__ == "__main__":
    main()
