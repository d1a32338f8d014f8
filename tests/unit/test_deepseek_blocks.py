"""DeepSeek-V3's and GLM-4.5's spans (blocks/mla.py, blocks/moe.py's GroupLimitedRouter, blocks/llama.py's
variants) against transformers' own model classes (DeepseekV3ForCausalLM, Glm4MoeForCausalLM) on the same
weights, in float32, with its default experts kernel (grouped_mm): a full forward is transformers' own
(bitwise but for the no-query-LoRA checkpoint, 2.4e-7 off), steps with a cache within 1e-5 of its own
through either way of computing latent attention, and the cache holds the latent, not keys and values."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, FineGrainedFP8Config

from bloompeer.blocks import Segment, float32_parameter_names, open_checkpoint
from bloompeer.blocks.kv_cache import CacheLayout
from bloompeer.blocks.llama import SwiGLU
from bloompeer.blocks.mla import LatentAttention, softmax_scale
from bloompeer.blocks.moe import SparseMoe
from bloompeer.peer.server.stored_blocks import StoredBlocks
from bloompeer.weight_format import WeightFormat

from ..conftest import DEEPSEEK_FAMILY
from ..helpers.fp8 import write_fp8_checkpoint
from .transformers_checks import assert_full_forward_equal, generate_positions

# a text past YaRN's original 16 positions, left-padded in one row
IDS = torch.tensor([[0, 0, 0, *range(5, 22)], list(range(30, 50))])
MASK = torch.tensor([[0, 0, 0] + [1] * 17, [1] * 20]).bool()
CHUNKS = [(0, 9), (9, 1), (10, 1), (11, 4), (15, 1), (13, 3), (16, 4)]  # (13, 3): 2 rejected tokens rolled back


def _loaded(name: str, deepseek_checkpoints) -> tuple:
    """(name, transformers' model, our spans 0:1 and 1:4)."""
    path = deepseek_checkpoints[name]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="grouped_mm")
    checkpoint = open_checkpoint(path)
    return name, reference.eval(), [checkpoint.load_span(0, 1, torch.float32), checkpoint.load_span(1, 4, torch.float32)]


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_FAMILY))
def variant(request, deepseek_checkpoints):
    return _loaded(request.param, deepseek_checkpoints)


@pytest.fixture(scope="module", params=sorted(name for name in DEEPSEEK_FAMILY if name.startswith("deepseek")))
def latent_variant(request, deepseek_checkpoints):
    """A variant with latent attention (GLM-4.5's is grouped-query)."""
    return _loaded(request.param, deepseek_checkpoints)


def test_block_0_is_dense_and_the_others_route_with_shared_experts(variant):
    name, reference, spans = variant
    mlps = [block.feed_forward for span in spans for block in span.blocks]
    assert isinstance(mlps[0], SwiGLU) and all(isinstance(mlp, SparseMoe) for mlp in mlps[1:])
    assert len(mlps[1].experts) == 8 and isinstance(mlps[1].shared_experts, SwiGLU)
    assert type(spans[1]).experts_of(reference.config) == ((0, 0), (8, 3), (8, 3), (8, 3))
    assert bool(reference.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0)  # a bias to ignore


@torch.no_grad()
def test_the_router_chooses_and_weighs_as_transformers(variant):
    """Group-limited choice on biased sigmoid scores, weights from the unbiased ones: the same experts in
    the same (unsorted) slot order and the same weights as DeepseekV3TopkRouter/Glm4MoeTopkRouter."""
    _, reference, spans = variant
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    _, weights, experts = reference.model.layers[2].mlp.gate(hidden)
    router = spans[1].blocks[1].feed_forward.gate
    mine_weights, mine_experts = router.choose(router.logits(hidden, [64]), 3)
    assert torch.equal(mine_experts, experts) and torch.equal(mine_weights, weights)
    unbiased = router.e_score_correction_bias.clone()
    router.e_score_correction_bias.zero_()
    try:
        assert not torch.equal(router.choose(router.logits(hidden, [64]), 3)[1], experts)  # the bias chose
    finally:
        router.e_score_correction_bias.copy_(unbiased)


@torch.no_grad()
def test_a_full_forward_equals_transformers(variant):
    name, reference, spans = variant
    for mask in (None, MASK):
        # bitwise for deepseek_v3 and glm4_moe; 2.4e-7 for the other (its expanded keys, measured)
        assert_full_forward_equal(reference, spans, IDS, mask, atol=0 if name != "deepseek_v3-no-q-lora" else 1e-6)


@torch.no_grad()
def test_steps_with_a_cache_and_a_rollback_equal_transformers(variant):
    """_check_steps_and_rollback, with the way of computing attention that the blocks choose per step."""
    _check_steps_and_rollback(variant)


@pytest.mark.parametrize("way", ["expanded", "absorbed"])
@torch.no_grad()
def test_latent_attentions_two_ways_each_equal_transformers(latent_variant, way, monkeypatch):
    monkeypatch.setattr(LatentAttention, "absorbs", lambda self, num_new, kv_length: way == "absorbed")
    _check_steps_and_rollback(latent_variant)


def _check_steps_and_rollback(variant):
    """Prefill, decode steps, a speculative step of 4, then 2 of its tokens rolled back (the cache written
    again from position 13). Latent attention's two ways, each forced, and the cheaper one chosen per step
    (a prompt expanded, a step absorbed): measured within 1.2e-6 (expanded) and 5.2e-6 (absorbed) of
    transformers' logits."""
    name, reference, spans = variant
    for mask in (None, MASK):
        caches = [span.new_cache(span.start, span.end, 2, 24, torch.float32) for span in spans]
        embedded = reference.model.embed_tokens(IDS)
        for position, num_new in CHUNKS:
            new = slice(position, position + num_new)
            attention = None if mask is None else mask[:, :new.stop]
            positions = None if mask is None else generate_positions(attention)
            expected = reference(IDS[:, :new.stop], attention_mask=attention, position_ids=positions).logits[:, new]
            hidden = embedded[:, new]
            for span, cache in zip(spans, caches):
                hidden = span(hidden, cache.begin_step(position, None if mask is None else mask[:, new], num_new),
                              cache)
            real = torch.ones(2, num_new, dtype=torch.bool) if mask is None else mask[:, new]
            logits = reference.lm_head(reference.model.norm(hidden))
            torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-5)


@torch.no_grad()
def test_transformers_own_cache_gives_what_a_full_forward_does(variant):
    """The reference of the test above is transformers' full forward of the text so far; its own cached
    steps agree with that within 1e-5 here too (so either is a fair reference)."""
    _, reference, _ = variant
    theirs = DynamicCache(config=reference.config)
    for position, num_new in CHUNKS[:4]:
        new = slice(position, position + num_new)
        mask, positions = MASK[:, :new.stop], generate_positions(MASK[:, :new.stop])
        stepped = reference(IDS[:, new], attention_mask=mask, position_ids=positions[:, new], cache=theirs,
                            use_cache=True).logits
        whole = reference(IDS[:, :new.stop], attention_mask=mask, position_ids=positions).logits[:, new]
        torch.testing.assert_close(stepped[MASK[:, new]], whole[MASK[:, new]], rtol=0, atol=1e-5)


def test_latent_attention_caches_its_latent_not_keys_and_values(variant):
    """DeepSeek-V3: kv_lora_rank + qk_rope_head_dim values a token and block (32 + 8 here), one part shared
    by every head; GLM-4.5: keys and values of its key/value heads. The bytes the budget counts are those."""
    name, reference, spans = variant
    config = reference.config
    cache = spans[1].new_cache(1, 4, 2, 16, torch.float32)
    if name.startswith("deepseek"):
        width = config.kv_lora_rank + config.qk_rope_head_dim
        assert spans[1].cache_layout(config, 1).values_per_token == width == 40
        assert [tuple(t.shape) for t in cache.update(1, torch.zeros(2, 1, 3, width))] == [(2, 1, 3, width)]
        full = 2 * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)  # 192
        assert width < full / 4
    else:
        width = 2 * config.num_key_value_heads * config.head_dim
        assert spans[1].cache_layout(config, 1) == CacheLayout.keys_and_values(config.num_key_value_heads, 32)
    assert spans[1].cache_nbytes(1, 4, 2, 16, torch.float32) == 3 * 2 * 16 * width * 4 + 2 * 16


def test_the_softmax_scale_is_transformers_own_with_yarns_mscale(latent_variant):
    name, reference, _ = latent_variant
    scaling = reference.model.layers[0].self_attn.scaling
    assert softmax_scale(reference.config) == scaling
    if name == "deepseek_v3":
        assert scaling != (16 + 8) ** -0.5  # YaRN's mscale_all_dim changed it


@torch.no_grad()
def test_a_sessions_tokens_are_computed_alike_whatever_shares_its_pass(variant):
    _, _, spans = variant
    span = spans[1]
    torch.manual_seed(0)
    segments = [Segment(torch.randn(1, length, 64)) for length in (5, 1, 3)]
    together = span.forward_segments(segments)
    for segment, output in zip(segments, together):
        torch.testing.assert_close(output, span(segment.hidden), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def fp8_deepseek(deepseek_checkpoints, tmp_path_factory):
    return write_fp8_checkpoint(deepseek_checkpoints["deepseek_v3"], tmp_path_factory.mktemp("fp8") / "deepseek_v3")


@torch.no_grad()
def test_deepseek_published_in_fp8_loads_as_transformers_dequantizes_it(fp8_deepseek, deepseek_checkpoints):
    """The published layout (float8_e4m3fn weights, weight_scale_inv per 8 x 8 block here, 128 x 128 in
    DeepSeek's files, quantization_config fp8): our weights are transformers' dequantized ones, bit for bit,
    and the float ones rounded; a full forward is transformers' own."""
    reference = AutoModelForCausalLM.from_pretrained(
        fp8_deepseek, dtype=torch.float32, experts_implementation="grouped_mm",
        quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    span = open_checkpoint(fp8_deepseek).load_span(0, 4, torch.float32)
    theirs = reference.model.layers[1]
    ours = span.blocks[1]
    assert torch.equal(ours.self_attn.kv_b_proj.weight, theirs.self_attn.kv_b_proj.weight)
    assert torch.equal(ours.self_attn.q_a_proj.weight, theirs.self_attn.q_a_proj.weight)
    gate, up = theirs.mlp.experts.gate_up_proj[5].chunk(2, dim=0)
    assert torch.equal(ours.feed_forward.experts[5].up_proj.weight, up)
    floats = open_checkpoint(deepseek_checkpoints["deepseek_v3"]).load_span(1, 2, torch.float32).blocks[0]
    error = (ours.self_attn.q_a_proj.weight - floats.self_attn.q_a_proj.weight).norm()
    assert 0 < error < 0.1 * floats.self_attn.q_a_proj.weight.norm()  # rounded to 8 bits, not garbled
    expected = reference.model(IDS, attention_mask=MASK, position_ids=generate_positions(MASK)).last_hidden_state
    hidden = span(reference.model.embed_tokens(IDS), MASK)
    torch.testing.assert_close(reference.model.norm(hidden)[MASK], expected[MASK], rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_served_in_bfloat16_the_router_chooses_as_transformers_bfloat16_model(name, deepseek_checkpoints):
    """transformers keeps the router's weight and correction bias in float32 whatever the dtype
    (_keep_in_fp32_modules_strict); so does a bfloat16 block loaded as a server loads it, and it chooses the
    same experts with the same weights for the same bfloat16 input (its weight rounded to bfloat16, it chose
    others). The memory plan counts them in float32."""
    path = deepseek_checkpoints[name]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="grouped_mm")
    theirs = reference.model.layers[2].mlp.gate
    assert theirs.weight.dtype == theirs.e_score_correction_bias.dtype == torch.float32
    block = open_checkpoint(path).load_span(2, 3, torch.bfloat16).blocks[0]
    router = block.feed_forward.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert block.feed_forward.experts[0].up_proj.weight.dtype == torch.bfloat16
    hidden = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    _, weights, experts = theirs(hidden)
    mine_weights, mine_experts = router.choose(router.logits(hidden, [2048]), 3)
    assert torch.equal(mine_experts, experts) and torch.equal(mine_weights, weights)
    rounded = router.weight.to(torch.bfloat16).float()
    assert not torch.equal(router.choose(torch.nn.functional.linear(hidden.float(), rounded), 3)[1], experts)
    float32_bytes = 4 * (router.weight.numel() + router.e_score_correction_bias.numel())
    assert float32_parameter_names(block) == {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
    stored = StoredBlocks(open_checkpoint(path), WeightFormat(dtype="bfloat16")).block_nbytes[2]
    assert stored == 2 * sum(t.numel() for t in block.state_dict().values()) + float32_bytes // 2
