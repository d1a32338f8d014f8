"""Shared fixtures: tiny random BLOOM checkpoints written to temp dirs (tests never download), and one
swarm for the whole run (a bootstrap peer and two servers as real processes on 127.0.0.1) that every
test directory shares, with servers of their own started on it where a test needs them.

Peers on 127.0.0.1 start through one fork server (bloompeer/peer/cli/fork_server.py): the real CLI in
processes of their own, without each one spending seconds of CPU on importing torch."""

from __future__ import annotations

import itertools
import shutil
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BloomForCausalLM

from bloompeer.p2p import NetworkConfig, PeerNode
from bloompeer.peer.cli.default_model import write_random_checkpoint
from bloompeer.peer.cli.fork_server import ForkServer
from bloompeer.peer.cli.local_swarm import LocalSwarm, stop_in_parallel

TINY_BLOCKS = 4

# Tiny checkpoints of the Llama family, one per thing it must get right (tests/unit/test_llama_blocks.py
# computes their blocks against transformers; tests/swarm/test_llama_family.py serves them).
LLAMA_FAMILY = {
    "llama": dict(model_type="llama", tie_word_embeddings=True),  # grouped-query attention (4 heads, 2 kv), default rope
    "llama3-rope": dict(model_type="llama", max_position_embeddings=32, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8)),  # texts of more than 8 tokens run past the original context
    "mistral": dict(model_type="mistral", sliding_window=5),  # a window shorter than the texts
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=2),  # biases;
    # layers 2 and 3 slide
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False),  # head_dim 32, not 64 / 4
}
# Tiny mixtures of experts, one per variant, each with what it must get right (tests/unit/test_moe_blocks.py
# computes their blocks against transformers; tests/swarm/test_moe_family.py serves them).
MOE_FAMILY = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=5),  # windows
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),  # a shared expert, weights as chosen
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      mlp_only_layers=[1], norm_topk_prob=True, head_dim=32),  # 3 experts a token; block 1 dense
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                    head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2),  # sinks
}
# DeepSeek-V3's architecture (multi-head latent attention, DeepSeek's experts) and GLM-4.5's (those experts on
# grouped-query attention), one checkpoint per thing they must get right (tests/unit/test_deepseek_blocks.py
# computes their blocks against transformers; tests/swarm/test_deepseek_family.py serves them). Each has a
# dense block 0 (first_k_dense_replace) and routes 3 of 8 experts within the best of its groups, with a
# random correction bias (deepseek_checkpoints) that changes which experts are chosen but not their weights.
_DEEPSEEK_EXPERTS = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1)
_LATENT_ATTENTION = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         rms_norm_eps=1e-5)
DEEPSEEK_FAMILY = {
    # a query LoRA, DeepSeek's interleaved rotation, YaRN (its mscale in the softmax scale) trained for 16 tokens
    # of 64, 4 groups of 2 experts (2 groups kept), weights renormalized and scaled
    "deepseek_v3": dict(model_type="deepseek_v3", q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        max_position_embeddings=64, rope_parameters=dict(
                            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                            mscale=0.8, mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
                        **_LATENT_ATTENTION, **_DEEPSEEK_EXPERTS),
    # no query LoRA, Llama's rotation, plain rope, one group, weights as chosen
    "deepseek_v3-no-q-lora": dict(model_type="deepseek_v3", q_lora_rank=None, rope_interleave=False, n_group=1,
                                  topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
                                  **_LATENT_ATTENTION, **_DEEPSEEK_EXPERTS),
    # grouped-query attention rotating half of each head, q/k/v biases, q/k norms, 2 groups, 1 kept
    "glm4_moe": dict(model_type="glm4_moe", attention_bias=True, use_qk_norm=True, head_dim=32, n_group=2, topk_group=1,
                     routed_scaling_factor=1.5, **_DEEPSEEK_EXPERTS),
}
# The Qwen3 checkpoint's tokenizer has a chat template of its own (`bloompeer api` must use it).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A 4-block BLOOM (hidden 64) with a byte-level tokenizer, sharded over many small files."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-bloom"), num_blocks=TINY_BLOCKS, hidden_size=64,
                                   num_heads=4, seed=1, max_shard_size="40KB")


@pytest.fixture(scope="session")
def llama_family_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """LLAMA_FAMILY's checkpoints (4 blocks, hidden 64), each sharded over a few files."""
    root = tmp_path_factory.mktemp("llama-family")
    paths = {name: write_random_checkpoint(root / name, num_blocks=TINY_BLOCKS, hidden_size=64, num_heads=4, seed=2,
                                           initializer_range=0.15, max_shard_size="100KB", **fields)
             for name, fields in LLAMA_FAMILY.items()}
    tokenizer = AutoTokenizer.from_pretrained(paths["qwen3"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(paths["qwen3"])
    return paths


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """MOE_FAMILY's checkpoints (4 blocks, hidden 64), each sharded over a few files."""
    root = tmp_path_factory.mktemp("moe-family")
    return {name: write_random_checkpoint(root / name, num_blocks=TINY_BLOCKS, hidden_size=64, num_heads=4, seed=3,
                                          initializer_range=0.15, max_shard_size="100KB", **fields)
            for name, fields in MOE_FAMILY.items()}


@pytest.fixture(scope="session")
def deepseek_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """DEEPSEEK_FAMILY's checkpoints (4 blocks, hidden 64), each sharded over a few files, with a random
    e_score_correction_bias (transformers initializes it to zeros)."""
    root = tmp_path_factory.mktemp("deepseek-family")
    paths = {}
    for name, fields in DEEPSEEK_FAMILY.items():
        path = write_random_checkpoint(root / name, num_blocks=TINY_BLOCKS, hidden_size=64, num_heads=4, seed=4,
                                       initializer_range=0.15, max_shard_size="100KB", **fields)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for layer in model.model.layers[fields["first_k_dense_replace"]:]:
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.1 * torch.randn(bias.shape, generator=generator))
        model.save_pretrained(path, max_shard_size="100KB")
        paths[name] = path
    return paths


# Qwen3-Next: Gated DeltaNet blocks 0-2 and a gated-attention block 3 (layer_types' default pattern), each with
# Qwen2-MoE's experts and a shared expert but for a dense block 1; half of each head rotated.
QWEN3_NEXT = dict(model_type="qwen3_next", head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                  mlp_only_layers=[1], rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                            partial_rotary_factor=0.5))


@pytest.fixture(scope="session")
def qwen3_next_checkpoint(tmp_path_factory) -> Path:
    """QWEN3_NEXT's checkpoint (4 blocks, hidden 64), sharded over a few files, with random norm weights, decays
    and dt biases (transformers initializes the norms to zeros: (1 + w) would be 1 everywhere)."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("qwen3-next"), num_blocks=TINY_BLOCKS, hidden_size=64,
                                   num_heads=4, seed=6, initializer_range=0.15, max_shard_size="100KB", **QWEN3_NEXT)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="session")
def qwen3_5_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Qwen3.5's and Qwen3.5-MoE's multimodal checkpoints in their published layout (tests/helpers/qwen3_5.py), by
    model type ("qwen3_5", "qwen3_5_moe"), 4 text blocks of hidden 64."""
    from .helpers.qwen3_5 import write_qwen3_5_checkpoint

    root = tmp_path_factory.mktemp("qwen3-5")
    return {name: write_qwen3_5_checkpoint(root / name, name, num_blocks=TINY_BLOCKS) for name in ("qwen3_5",
                                                                                                   "qwen3_5_moe")}


@pytest.fixture(scope="session")
def kimi_k25_checkpoint(tmp_path_factory) -> Path:
    """Kimi K2.5's multimodal checkpoint in its published layout (tests/helpers/kimi_k25.py), whose text model is
    DEEPSEEK_FAMILY's deepseek_v3 (a query LoRA, YaRN, group-limited routing, a correction bias), with weights of
    its own."""
    from .helpers.kimi_k25 import write_kimi_k25_checkpoint

    fields = {name: value for name, value in DEEPSEEK_FAMILY["deepseek_v3"].items() if name != "model_type"}
    return write_kimi_k25_checkpoint(tmp_path_factory.mktemp("kimi-k25") / "kimi_k25", fields, num_blocks=TINY_BLOCKS)


@pytest.fixture(scope="session")
def reference_model(tiny_checkpoint) -> BloomForCausalLM:
    """transformers' own BLOOM on the same weights: the numeric reference."""
    return BloomForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def fork_server():
    with ForkServer() as server:
        yield server


@pytest.fixture(scope="session")
def swarm(fork_server, tiny_checkpoint, tmp_path_factory):
    with LocalSwarm(tiny_checkpoint, [(0, 2), (2, 4)], log_dir=tmp_path_factory.mktemp("swarm-logs"),
                    launch=fork_server.launch) as swarm:
        yield swarm


@pytest_asyncio.fixture
async def node(swarm):
    """A client-mode network peer in the shared swarm, for tests that speak the wire protocol (tests/wire.py)."""
    node = await PeerNode.create(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True))
    yield node
    await node.shutdown()


@pytest.fixture
def fresh_model(tiny_checkpoint, tmp_path):
    """A copy of the tiny checkpoint under a name of its own, so its servers serve no other test."""
    path = tmp_path / f"model-{uuid.uuid4().hex[:8]}"
    shutil.copytree(tiny_checkpoint, path)
    return path


@pytest.fixture
def start_servers(swarm, fresh_model):
    """start_servers([(0, 4), (0, 2)], *extra_args, program=None) -> PeerProcesses of `fresh_model`,
    started in parallel on the shared bootstrap peer; all stopped after the test."""
    started, numbers = [], itertools.count()  # numbers: each server's log its own, also when started from threads

    def start(spans, *extra_args, program=None, model=None):
        servers = [swarm.add_server(a, b, model=model or fresh_model, wait=False, extra_args=extra_args,
                                    name=f"{fresh_model.name}-{next(numbers)}", program=program)
                   for a, b in spans]
        started.extend(servers)
        deadline = time.monotonic() + 120
        for server in servers:
            server.wait_online(deadline)
        return servers

    yield start
    stop_in_parallel(started)
