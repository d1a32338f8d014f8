"""DeepSeek-V3's block (multi-head latent attention, DeepSeek's experts) through a local swarm, next to
transformers and a grouped-query block in the same run.

DeepSeek-V3's attention dimensions (16 heads, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128, no query
LoRA) at hidden 2048, with 64 routed experts of width 1408, 6 a token (group-limited: 8 groups, 4 kept),
one shared expert, every block sparse, random weights and a small vocabulary (only blocks are measured):
  1. decode: median time between consecutive tokens of greedy generate (16-token prompt) through 2
     servers splitting the blocks, against transformers' DeepseekV3ForCausalLM (its default experts kernel)
     in this process; the runners take turns in each of --rounds rounds;
  2. cache bytes a session holds per token and block (SessionCache, what the servers allocate and the
     budget counts: the family's layout and the padding mask's byte), against a grouped-query block of the
     same width (Qwen3-30B-A3B's attention: hidden 2048, 32 heads, 4 KV heads of 128);
  3. sessions of 4096 tokens that one server admits, opened one after another (a one-token step each)
     until it refuses one: a Qwen3-shape server with --cache-tokens 32768 (8 such sessions), and a
     DeepSeek-V3-shape server given the same bytes of cache (its --cache-tokens from the two layouts).

    python benchmarks/mla.py                    # as many blocks as fit, at most 4
    python benchmarks/mla.py --blocks 2 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.moe import DENSE, client_config, row, swarm_decode  # noqa: E402
from bloompeer.blocks import open_checkpoint  # noqa: E402
from bloompeer.errors import BloompeerError  # noqa: E402
from bloompeer.peer.cli.default_model import write_random_checkpoint  # noqa: E402
from bloompeer.peer.cli.local_swarm import LocalSwarm, split_blocks  # noqa: E402
from bloompeer.peer.client.swarm_client import SwarmClient  # noqa: E402
from bloompeer.peer.server.memory_plan import available_bytes  # noqa: E402

COMMON = dict(hidden_size=2048, vocab_size=512, max_shard_size="2GB")
MLA = dict(model_type="deepseek_v3", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
           v_head_dim=128, q_lora_rank=None, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
           n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=0, norm_topk_prob=True,
           routed_scaling_factor=2.5, **COMMON)
GQA = DENSE  # Qwen3-30B-A3B's attention (hidden 2048, 32 heads, 4 KV heads of 128), a dense MLP: its cache counts
SESSION_TOKENS = 4096
GQA_CACHE_TOKENS = 8 * SESSION_TOKENS
PROMPT_TOKENS = 16
GOALS = {"decode vs transformers": 1.10}


def blocks_that_fit() -> int:
    """Blocks held twice (servers, local reference) in the memory available, leaving 3 GiB to the rest; at most 4."""
    attention = 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048
    block = 4 * (attention + (64 + 1) * 3 * 2048 * 1408)  # float32: attention, routed and shared experts
    return max(1, min(4, int((available_bytes("cpu") - 3 * 2**30) // (2 * block))))


def bytes_per_token_and_block(path: Path, dtype: torch.dtype) -> float:
    """What a session of SESSION_TOKENS reserves on a server of one block, per token."""
    checkpoint = open_checkpoint(path)
    with torch.device("meta"):
        span = checkpoint.family.span_class(checkpoint.config(), 0, 1)
    return span.cache_nbytes(0, 1, 1, SESSION_TOKENS, dtype) / SESSION_TOKENS


def sessions_admitted(path: Path, cache_tokens: int) -> int:
    """Sessions of SESSION_TOKENS a server of a one-block model with --cache-tokens `cache_tokens` takes, opened one
    after another and each kept open (a one-token step opens it on the server), until one is refused."""
    flags = ["--max-length", str(SESSION_TOKENS), "--cache-tokens", str(cache_tokens), "--max-sessions-per-peer", "256"]
    hidden_size = open_checkpoint(path).config().hidden_size
    with LocalSwarm(path, [(0, 1)], server_args=flags) as swarm:
        config = dataclasses.replace(client_config(swarm), alloc_timeout_s=1.0, missing_blocks_timeout_s=3.0,
                                     recovery_timeout_s=3.0)
        client = SwarmClient.connect(open_checkpoint(path), config)
        opened = []
        try:
            while len(opened) < 256:
                session = client.open_session(max_length=SESSION_TOKENS)
                try:
                    client.runtime.run(session.step(torch.randn(1, 1, hidden_size)))
                except BloompeerError as exc:
                    print(f"  session {len(opened) + 1} refused: {type(exc).__name__}: {str(exc)[:160]}",
                          file=sys.stderr, flush=True)
                    client.close_session(session)
                    break
                opened.append(session)
        finally:
            for session in opened:
                client.close_session(session)
            client.shutdown()
    return len(opened)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=None, help="blocks of the model (default: as many as fit, <= 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    num_blocks = args.blocks or blocks_that_fit()
    placement = split_blocks(num_blocks, 2) if num_blocks > 1 else [(0, 1)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; DeepSeek-V3's attention at hidden 2048, "
          f"64 experts of 1408, 6 a token; {num_blocks} blocks, servers {placement}; {args.rounds} rounds", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bloompeer-mla-") as tmp:
        print("writing the random checkpoints...", file=sys.stderr, flush=True)
        mla = write_random_checkpoint(Path(tmp) / "mla", num_blocks=num_blocks, **MLA)
        gqa = write_random_checkpoint(Path(tmp) / "gqa", num_blocks=1, **GQA)
        prompt = torch.randint(4, COMMON["vocab_size"], (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))

        print("1. decode through 2 servers and in transformers...", file=sys.stderr, flush=True)
        local = AutoModelForCausalLM.from_pretrained(mla, dtype=torch.float32, experts_implementation="grouped_mm")
        steps = swarm_decode(mla, placement, prompt, args, local=local.eval())
        del local
        rows.append(row(f"decode step, {num_blocks} blocks, 2 servers vs transformers", steps["bloompeer"],
                        steps["local"], f"<= {GOALS['decode vs transformers']}"))

        print("2. cache bytes per token and block...", file=sys.stderr, flush=True)
        for dtype in (torch.float32, torch.bfloat16):
            latent, grouped = bytes_per_token_and_block(mla, dtype), bytes_per_token_and_block(gqa, dtype)
            goal = f"{(512 + 64) * dtype.itemsize} + 1"  # the latent and rotated key, and the padding mask's byte
            rows.append(row(f"cache bytes / token / block, {str(dtype)[6:]}, vs GQA", [latent], grouped, goal, "B"))

        print("3. sessions of 4096 tokens in one server's cache budget...", file=sys.stderr, flush=True)
        budget = GQA_CACHE_TOKENS * bytes_per_token_and_block(gqa, torch.float32)
        mla_cache_tokens = int(budget // bytes_per_token_and_block(mla, torch.float32))
        grouped_sessions = sessions_admitted(gqa, GQA_CACHE_TOKENS)
        one_block = write_random_checkpoint(Path(tmp) / "mla-1", num_blocks=1, **MLA)  # a session spans the model
        latent_sessions = sessions_admitted(one_block, mla_cache_tokens)
        rows.append(row(f"4096-token sessions in {budget / 2**20:.0f} MiB of cache vs GQA", [float(latent_sessions)],
                        float(grouped_sessions), f"--cache-tokens {mla_cache_tokens} / {GQA_CACHE_TOKENS}", "sess."))
    print(f"\n{'':<44} {'bloompeer':>10} {'baseline':>10} {'unit':<6} {'ratio':>6} {'goal':<8} per round")
    for line in rows:
        print(line)
    print(f"decode rounds, ms: bloompeer {' '.join(f'{v:.1f}' for v in steps['bloompeer'])}; "
          f"transformers {' '.join(f'{v:.1f}' for v in steps['local'])}")


if __name__ == "__main__":
    main()
