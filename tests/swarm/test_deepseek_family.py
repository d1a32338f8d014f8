"""DeepSeek-V3's architecture and GLM-4.5's through real swarms of CLI servers: tokens equal transformers'
own model class (AutoModelForCausalLM: DeepseekV3ForCausalLM, Glm4MoeForCausalLM) on the same weights in
float32, loaded with `experts_implementation="grouped_mm"` (its default experts kernel, named).

Every checkpoint of DEEPSEEK_FAMILY (tests/conftest.py: DeepSeek-V3 with and without a query LoRA, dense
block 0, group-limited routing with a correction bias, YaRN trained for 16 positions; GLM-4.5) is served
by two servers (blocks 0:2 and 2:4) on the shared bootstrap peer, all started at once, and so is Kimi K2.5's
multimodal checkpoint (served as its text model, a DeepSeek-V3), as it is and, by one server of all four blocks,
with its routed experts in INT4 as Moonshot publishes them (compressed-tensors' pack-quantized); the servers
cache latent attention's latent, not keys and values. Texts run past YaRN's original 16 positions. What needs
servers of its own (a kill) gets a copy of the DeepSeek-V3 checkpoint under another name.
"""

from __future__ import annotations

import functools
import shutil
import time
from contextlib import ExitStack

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, FineGrainedFP8Config

from bloompeer import AutoDistributedModelForCausalLM, DistributedLlamaForCausalLM
from bloompeer.errors import RequestError

from ..conftest import DEEPSEEK_FAMILY
from ..helpers.fp8 import write_fp8_checkpoint
from ..helpers.pack_quantized import write_dequantized_checkpoint, write_pack_quantized_checkpoint
from .deep_prompts import assert_prompt_gradients_equal
from .family_checks import (
    NEW_TOKENS, PROMPT, assert_concurrent_sessions_equal_alone, assert_greedy_equal,
    assert_padded_batch_and_beam_search_equal, assert_replayed_around_a_kill, assert_speculative_equals_greedy,
    client_config, first_block_draft, started_servers,
)

# PROMPT's 11 tokens and NEW_TOKENS' 14 (family_checks.py): 25 positions, past YaRN's original 16
VARIANTS = sorted(DEEPSEEK_FAMILY)  # deepseek_v3, deepseek_v3-no-q-lora, glm4_moe
LATENT = [name for name in VARIANTS if name.startswith("deepseek")]
SERVED = [*VARIANTS, "kimi_k25", "kimi_k25-int4"]
# each checkpoint's servers' blocks; one server for the INT4 checkpoint: what it checks is how its blocks load
SPANS = {name: [(0, 2), (2, 4)] for name in SERVED} | {"kimi_k25-int4": [(0, 4)]}


@functools.cache
def _reference(path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="grouped_mm")
    return model.eval()


@pytest.fixture(scope="module")
def references(deepseek_checkpoints):
    yield lambda name: _reference(deepseek_checkpoints[name])
    _reference.cache_clear()


@pytest.fixture(scope="module")
def served_checkpoints(deepseek_checkpoints, kimi_k25_checkpoint, tmp_path_factory):
    """SERVED's checkpoints: DEEPSEEK_FAMILY's, Kimi K2.5's, and Kimi K2.5's with its routed experts in INT4 as
    Moonshot publishes them (compressed-tensors' pack-quantized format)."""
    int4 = write_pack_quantized_checkpoint(kimi_k25_checkpoint, tmp_path_factory.mktemp("int4") / "kimi_k25-int4")
    return deepseek_checkpoints | {"kimi_k25": kimi_k25_checkpoint, "kimi_k25-int4": int4}


@pytest.fixture(scope="module")
def deepseek_servers(swarm, served_checkpoints):
    with started_servers(swarm, served_checkpoints, SPANS) as servers:
        yield servers


@pytest.fixture(scope="module")
def clients(deepseek_servers, swarm, served_checkpoints):
    """clients(name) -> our model of DEEPSEEK_FAMILY[name] (or Kimi K2.5) through the swarm, made once for the
    module, pushing between servers for every other variant and trusting only that variant's servers."""
    made = {}
    with ExitStack() as stack:
        def client(name):
            if name not in made:
                trusted = tuple(server.peer_id_str for server in deepseek_servers[name])
                config = client_config(swarm, push=SERVED.index(name) % 2 == 1, trusted_servers=trusted)
                made[name] = stack.enter_context(
                    AutoDistributedModelForCausalLM.from_pretrained(served_checkpoints[name], client_config=config))
            return made[name]

        yield client


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, clients, references):
    return clients(request.param), references(request.param)


@torch.inference_mode()
def test_greedy_tokens_equal_transformers(pair):
    ours, reference = pair
    assert isinstance(ours, DistributedLlamaForCausalLM)
    assert_greedy_equal(ours, reference, min_new_tokens=NEW_TOKENS)


@torch.inference_mode()
def test_teacher_forced_logits_within_1e_4(pair):
    """A full forward of 2 x 20 tokens (past YaRN's original 16) against transformers'."""
    ours, reference = pair
    ids = torch.randint(4, 250, (2, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)


@torch.inference_mode()
def test_left_padded_batch_and_beam_search(pair):
    """Beam search reorders the servers' cached latents (or keys and values) as transformers reorders its cache."""
    assert_padded_batch_and_beam_search_equal(*pair)


@torch.inference_mode()
@pytest.mark.parametrize("how", ["draft-model", "prompt-lookup"])
@pytest.mark.parametrize("name", LATENT)
def test_speculative_decoding_rolls_the_latent_cache_back_and_equals_greedy(clients, references, name, how, rewinds):
    """A verify pass of several proposed tokens, then the rejected ones' latents dropped from the servers'
    caches (the next step written at an earlier position): the tokens are plain greedy decoding's."""
    ours, reference = clients(name), references(name)
    speculation = dict(assistant_model=first_block_draft(reference)) if how == "draft-model" \
        else dict(prompt_lookup_num_tokens=3)
    assert_speculative_equals_greedy(ours, reference, rewinds, **speculation)


@torch.inference_mode()
def test_eight_concurrent_sessions_each_equal_alone(clients, references):
    """Eight sessions of different prompt lengths at once through DeepSeek-V3's servers: however the
    servers batch their steps (that is the machine's speed), each session's tokens equal transformers' alone."""
    assert_concurrent_sessions_equal_alone(clients("deepseek_v3"), references("deepseek_v3"))


def test_prompt_tuning_gradients_equal_local_autograd(deepseek_servers, swarm, deepseek_checkpoints, references):
    """DeepSeek-V3: a dense block 0 and sparse blocks 1-3, latent attention, each block with deep prompts of its
    own; the servers differentiate through latent attention, the routers' weights and the shared experts."""
    path, reference = deepseek_checkpoints["deepseek_v3"], references("deepseek_v3")
    with DistributedLlamaForCausalLM.from_pretrained(
            path, client_config=client_config(swarm), tuning_mode="deep_ptune", pre_seq_len=3) as ours:
        assert_prompt_gradients_equal(ours, reference)


@pytest.fixture
def own_deepseek(deepseek_checkpoints, tmp_path):
    """A copy of the DeepSeek-V3 checkpoint under a name of its own, so its servers serve no other test."""
    path = tmp_path / f"deepseek_v3-{time.monotonic_ns() % 10**8}"
    shutil.copytree(deepseek_checkpoints["deepseek_v3"], path)
    return path


@torch.inference_mode()
def test_a_server_killed_mid_generation_is_replayed_around(start_servers, swarm, own_deepseek, references):
    """The client replays its inputs to the replacement server, which rebuilds the latent cache from them."""
    assert_replayed_around_a_kill(start_servers, swarm, own_deepseek, references("deepseek_v3"))


@torch.inference_mode()
def test_deepseek_served_from_its_fp8_checkpoint_generates_as_transformers_loads_it(start_servers, swarm,
                                                                                   deepseek_checkpoints, tmp_path):
    """The published layout (every linear weight of the blocks float8_e4m3fn with weight_scale_inv per block):
    servers dequantize each block as it loads; the tokens equal those of transformers' model loaded from the
    same files (its own dequantization)."""
    path = write_fp8_checkpoint(deepseek_checkpoints["deepseek_v3"],
                                tmp_path / f"deepseek-fp8-{time.monotonic_ns() % 10**8}")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="grouped_mm",
                                                     quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    start_servers([(0, 2), (2, 4)], model=path)
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=client_config(swarm)) as ours:
        assert ours.generate(PROMPT, **kwargs).tolist() == reference.generate(PROMPT, **kwargs).tolist()


@torch.inference_mode()
def test_kimi_k25_served_from_its_int4_experts_generates_as_transformers_on_their_dequantized_weights(
        clients, served_checkpoints, tmp_path):
    """Kimi K2.5 in its published layout with its routed experts INT4 in compressed-tensors' pack-quantized
    format (groups of 32 inputs, bfloat16 scales; attention, shared experts and the dense block in `ignore`): the
    servers dequantize each block as it loads; greedy tokens equal, and teacher-forced logits within 1e-4 of,
    transformers' class on the same weights as the compressed-tensors package dequantizes them, in float32."""
    floats = write_dequantized_checkpoint(served_checkpoints["kimi_k25-int4"], tmp_path / "kimi_k25-dequantized")
    reference = AutoModelForImageTextToText.from_pretrained(floats, dtype=torch.float32).eval()
    ours = clients("kimi_k25-int4")
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert ours.generate(PROMPT, **kwargs).tolist() == reference.generate(PROMPT, **kwargs).tolist()
    ids = torch.randint(4, 250, (2, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)


@torch.inference_mode()
def test_kimi_k25_served_as_its_text_model_generates_as_transformers_and_refuses_images(clients, kimi_k25_checkpoint):
    """Kimi K2.5's multimodal checkpoint in its published layout (text_config, language_model.*): the servers hold
    its text model's blocks, the client its embeddings and head; greedy tokens equal, and teacher-forced logits
    within 1e-4 of, transformers' class for the checkpoint (Kimi_K25ForConditionalGeneration, text only: its text
    model is DeepseekV3ForCausalLM's computation, tests/unit/test_kimi_k25.py). Images are refused, not dropped."""
    ours = clients("kimi_k25")
    reference = AutoModelForImageTextToText.from_pretrained(kimi_k25_checkpoint, dtype=torch.float32).eval()
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert ours.generate(PROMPT, **kwargs).tolist() == reference.generate(PROMPT, **kwargs).tolist()
    ids = torch.randint(4, 250, (2, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
    with pytest.raises(RequestError, match="pixel_values: images, video and sound are not taken"):
        ours.generate(PROMPT, pixel_values=torch.zeros(4, 3, 14, 14), **kwargs)
