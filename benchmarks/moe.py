"""A mixture of experts through a local swarm, next to transformers and a dense block in the same run.

Qwen3-30B-A3B's block shape with random weights (hidden 2048, 32 heads, 4 KV heads, head_dim 128,
128 experts of 768, 8 a token; a small vocabulary, since only the blocks are measured), as many
blocks as fit twice in the memory available (the servers' copy and the local reference's), and:
  1. decode: median time between consecutive tokens of greedy generate (16-token prompt) through 2
     servers splitting the blocks, against the model's own transformers class (Qwen3MoeForCausalLM,
     its default experts kernel) locally; runners take turns in each of --rounds rounds;
  2. the same through 2 servers of a dense Qwen3 of the same shape whose MLP holds the active
     parameters of a token (intermediate 8 x 768 = 6144): what routing adds to a step;
  3. 8 sessions stepping at once on one server of every block (light clients: random hidden states),
     steps/s beside the floor measured in this process afterwards: 8 sessions' steps in one pass;
  4. servers storing the blocks as int8 and int4 (--quant): bytes of the blocks (the memory plan's
     figure) and the decode step, beside float32's.

    python benchmarks/moe.py                    # as many blocks as fit (4 on a 24 GiB machine)
    python benchmarks/moe.py --blocks 2 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.inference import decode_step_ms  # noqa: E402
from benchmarks.throughput import PassCounter, light_clients, measured, pass_floor  # noqa: E402
from bloompeer import AutoDistributedModelForCausalLM, ClientConfig, NetworkConfig  # noqa: E402
from bloompeer.blocks import open_checkpoint  # noqa: E402
from bloompeer.peer.cli.default_model import write_random_checkpoint  # noqa: E402
from bloompeer.peer.cli.local_swarm import LocalSwarm, split_blocks  # noqa: E402
from bloompeer.peer.client.swarm_client import SwarmClient  # noqa: E402
from bloompeer.peer.server.memory_plan import available_bytes  # noqa: E402
from bloompeer.peer.server.stored_blocks import StoredBlocks  # noqa: E402
from bloompeer.weight_format import WeightFormat  # noqa: E402

SHAPE = dict(hidden_size=2048, num_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=512,
             max_shard_size="2GB")
MOE = dict(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
           norm_topk_prob=True, **SHAPE)
DENSE = dict(model_type="qwen3", intermediate_size=8 * 768, **SHAPE)  # a token's active MLP parameters
SESSIONS = 8
PROMPT_TOKENS = 16
GOALS = {"decode vs transformers": 1.10, "decode vs dense": 1.3, "steps/s vs floor": 0.85,
         "int8 bytes": 0.27, "int4 bytes": 0.16}


def blocks_that_fit() -> int:
    """Blocks held twice (servers, local reference) in the memory available, leaving 3 GiB to the rest."""
    block = 4 * (4 * 2048 * 4096 + 2 * 2048 * 512 + 128 * 3 * 2048 * 768)  # float32: attention, experts
    return max(1, int((available_bytes("cpu") - 3 * 2**30) // (2 * block)))


def client_config(swarm: LocalSwarm) -> ClientConfig:
    return ClientConfig(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True),
                        request_timeout_s=300.0)


def swarm_decode(path: Path, placement: list[tuple[int, int]], prompt: torch.Tensor, args,
                 server_args: tuple[str, ...] = (), local=None) -> dict[str, list[float]]:
    """{"bloompeer": per round, and "local" if given}: decode steps through servers of `placement`."""
    flags = ["--max-length", "256", "--cache-tokens", "4096", *server_args]
    with LocalSwarm(path, placement, server_args=flags) as swarm, \
            AutoDistributedModelForCausalLM.from_pretrained(path, client_config=client_config(swarm)) as ours:
        runners = {"bloompeer": ours} | ({"local": local} if local is not None else {})
        for model in runners.values():
            decode_step_ms(model, prompt, 4, 1)  # warm-up: caches, route, connections
        results = {runner: [] for runner in runners}
        for round_index in range(args.rounds):
            for runner, model in runners.items():
                results[runner].append(decode_step_ms(model, prompt, args.new_tokens, 1))
            print(f"  round {round_index + 1}: " + ", ".join(f"{r} {v[-1]:.1f} ms" for r, v in results.items()),
                  file=sys.stderr, flush=True)
    return results


def sessions_on_one_server(path: Path, num_blocks: int, args) -> tuple[list[float], list[float], float]:
    """(steps/s of SESSIONS light sessions per round, requests per pass per round, the in-process floor's
    steps/s): the floor is measured once the server is gone, its memory freed."""
    flags = ["--max-length", str(PROMPT_TOKENS + args.steps + 8), "--metrics-port", "0"]
    steps_per_s, shared = [], []
    with LocalSwarm(path, [(0, num_blocks)], server_args=flags) as swarm:
        server = swarm.servers[0]
        counter = PassCounter(next(line.split(" ", 1)[1] for line in server.stdout if line.startswith("metrics: ")))
        client = SwarmClient.connect(open_checkpoint(path), client_config(swarm))
        try:
            light_clients(client, SHAPE["hidden_size"], 1, 2, server.pid)  # warm-up
            for round_index in range(args.rounds):
                result = measured(counter, light_clients, client, SHAPE["hidden_size"], SESSIONS, args.steps,
                                  server.pid)
                steps_per_s.append(result.steps_per_s)
                shared.append(result.requests_per_pass)
                print(f"  round {round_index + 1}: {result}", file=sys.stderr, flush=True)
        finally:
            client.shutdown()
    _, many_ms = pass_floor(path, num_blocks, SESSIONS, args.rounds)
    return steps_per_s, shared, SESSIONS / (many_ms / 1000)


def row(label: str, ours: list[float], base: list[float] | float, goal: str, unit: str = "ms") -> str:
    base_median = base if isinstance(base, float) else statistics.median(base)
    ratio = statistics.median(ours) / base_median
    per_round = "" if isinstance(base, float) else " ".join(f"{a / b:.2f}" for a, b in zip(ours, base))
    return f"{label:<44} {statistics.median(ours):>10.1f} {base_median:>10.1f} {unit:<6} {ratio:>6.2f} " \
           f"{goal:<8} {per_round}"


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=None, help="blocks of the model (default: as many as fit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each session in part 3")
    args = parser.parse_args()
    num_blocks = args.blocks or blocks_that_fit()
    placement = split_blocks(num_blocks, 2) if num_blocks > 1 else [(0, 1)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Qwen3-30B-A3B's block shape, {num_blocks} "
          f"blocks, servers {placement}; {args.rounds} rounds", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bloompeer-moe-") as tmp:
        print("writing the random checkpoints...", file=sys.stderr, flush=True)
        moe = write_random_checkpoint(Path(tmp) / "moe", num_blocks=num_blocks, **MOE)
        dense = write_random_checkpoint(Path(tmp) / "dense", num_blocks=num_blocks, **DENSE)
        prompt = torch.randint(4, SHAPE["vocab_size"], (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))

        print("1. decode through 2 servers and in transformers...", file=sys.stderr, flush=True)
        local = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
        first = swarm_decode(moe, placement, prompt, args, local=local)
        del local
        rows.append(row("decode step, MoE, 2 servers vs transformers", first["bloompeer"], first["local"],
                        f"<= {GOALS['decode vs transformers']}"))
        print("2. decode through 2 servers of the dense block of the same active parameters...", file=sys.stderr,
              flush=True)
        dense_steps = swarm_decode(dense, split_blocks(num_blocks, 2) if num_blocks > 1 else [(0, 1)], prompt, args)
        rows.append(row("decode step, MoE vs dense (active params)", first["bloompeer"], dense_steps["bloompeer"],
                        f"<= {GOALS['decode vs dense']}"))

        print(f"3. {SESSIONS} sessions on one server...", file=sys.stderr, flush=True)
        steps, shared, floor = sessions_on_one_server(moe, num_blocks, args)
        rows.append(row(f"{SESSIONS} sessions on one server vs in-process floor", steps, floor,
                        f">= {GOALS['steps/s vs floor']}", "steps/s") + f" ({statistics.median(shared):.1f} per pass)")

        print("4. quantized experts...", file=sys.stderr, flush=True)
        checkpoint = open_checkpoint(moe)
        float_bytes = StoredBlocks(checkpoint, WeightFormat()).span_nbytes(0, num_blocks)
        float_step = swarm_decode(moe, [(0, num_blocks)], prompt, args)["bloompeer"]
        for kind in ("int8", "int4"):
            stored = StoredBlocks(checkpoint, WeightFormat.of(kind)).span_nbytes(0, num_blocks)
            rows.append(row(f"bytes of the blocks, {kind} vs float32", [stored / 2**20], float(float_bytes / 2**20),
                            f"<= {GOALS[kind + ' bytes']}", "MiB"))
            steps_quant = swarm_decode(moe, [(0, num_blocks)], prompt, args, ("--quant", kind))["bloompeer"]
            rows.append(row(f"decode step, one server, {kind} vs float32", steps_quant, float_step, "< 1"))
    print(f"\n{'':<44} {'bloompeer':>10} {'baseline':>10} {'unit':<6} {'ratio':>6} {'goal':<8} per round")
    for line in rows:
        print(line)


if __name__ == "__main__":
    main()
