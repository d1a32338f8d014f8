"""The Llama family's spans (blocks/llama.py) and rotations (blocks/rope.py) against transformers'
own model classes (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) on
the same weights, in float32."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from bloompeer.blocks import Segment, open_checkpoint
from bloompeer.blocks.llama import LlamaSpan
from bloompeer.blocks.rope import ROPE_TYPES, rope_frequencies
from bloompeer.peer.cli.default_model import write_random_checkpoint

from ..conftest import LLAMA_FAMILY
from .transformers_checks import assert_cached_steps_equal, assert_full_forward_equal

IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 12]).bool()
CHUNKS = [(0, 5), (5, 1), (6, 1), (7, 4), (11, 1)]  # a prefill, decode steps, a speculative-sized step


@pytest.fixture(scope="module", params=sorted(LLAMA_FAMILY))
def variant(request, llama_family_checkpoints):
    """(name, transformers' model, our spans 0:1 and 1:4) for each checkpoint of LLAMA_FAMILY."""
    path = llama_family_checkpoints[request.param]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    checkpoint = open_checkpoint(path)
    return request.param, reference, [checkpoint.load_span(0, 1, torch.float32),
                                      checkpoint.load_span(1, 4, torch.float32)]


@torch.no_grad()
def test_a_full_forward_is_bitwise_transformers(variant):
    """One request alone, written op for op: equal, not close (padding included, real positions)."""
    _, reference, spans = variant
    for mask in (None, MASK):
        assert_full_forward_equal(reference, spans, IDS, mask, atol=0)


@torch.no_grad()
def test_steps_with_a_cache_equal_transformers_with_its_cache(variant):
    """Prefill, decode and multi-token steps against transformers' DynamicCache, step for step."""
    _, reference, spans = variant
    for mask in (None, MASK):
        assert_cached_steps_equal(reference, spans, IDS, mask, CHUNKS, 16)


@torch.no_grad()
def test_batched_segments_equal_requests_alone(variant):
    _, _, spans = variant
    span = spans[1]
    hidden_size = span.config.hidden_size
    torch.manual_seed(0)

    def sessions():
        caches, steps = [], []
        for batch, num_new, cached in [(2, 5, 0), (1, 1, 7), (3, 2, 3)]:
            cache = span.new_cache(span.start, span.end, batch, 16, torch.float32)
            if cached:
                span(torch.randn(batch, cached, hidden_size), cache.begin_step(0, None, cached), cache)
            mask = torch.ones(batch, num_new, dtype=torch.bool)
            mask[0, 0] = num_new == 1 or cached > 0  # some padding in one session's new tokens
            caches.append(cache)
            steps.append((torch.randn(batch, num_new, hidden_size), mask))
        return caches, steps

    torch.manual_seed(1)
    caches, steps = sessions()
    alone = [span(h, c.begin_step(c.length, m, h.shape[1]), c) for c, (h, m) in zip(caches, steps)]
    torch.manual_seed(1)
    caches, steps = sessions()
    together = span.forward_segments([Segment(h, c.begin_step(c.length, m, h.shape[1]), c) for c, (h, m) in
                                      zip(caches, steps)])
    for one, many in zip(alone, together):
        torch.testing.assert_close(many, one, rtol=0, atol=1e-5)


def test_the_cache_holds_kv_heads_times_head_dim(variant):
    name, reference, spans = variant
    config = reference.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = spans[1].new_cache(1, 4, 2, 16, torch.float32)
    assert cache.keys.shape == (3, 2, config.num_key_value_heads, 16, head_dim)
    assert spans[1].cache_nbytes(1, 4, 2, 16, torch.float32) == 2 * 3 * 2 * 16 * config.num_key_value_heads * head_dim * 4 \
        + 2 * 16
    assert config.num_key_value_heads < config.num_attention_heads  # the fixtures all use grouped-query attention


def test_a_decode_step_never_copies_the_past():
    """Grouped-query attention over a long cache: no allocation in a one-token step is anywhere near
    the size of one block's cached keys (a repeat of the keys per query head would be twice that; the
    step's masks and position indices take 16 bytes per cached token, the keys 512 here)."""
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=1, vocab_size=10)
    span = LlamaSpan(config, 0, 1).eval()
    cache = span.new_cache(0, 1, 1, 8192, torch.float32)
    with torch.no_grad():
        span(torch.randn(1, 8000, 256), cache.begin_step(0, None, 8000), cache)
        past_bytes = cache.keys[0, :, :, :8000].numel() * 4  # 4 MB
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            span(torch.randn(1, 1, 256), cache.begin_step(8000, None, 1), cache)
    largest = max(event.cpu_memory_usage for event in prof.key_averages())
    assert 0 < largest < past_bytes / 4, (largest, past_bytes)


@torch.no_grad()
def test_dynamic_rope_grows_and_resets_as_transformers_does(tmp_path):
    """Dynamic rope's frequencies follow the session's longest length (kept on the device, rope.py): steps that
    run past the trained length of 8 and a session that starts again below it equal transformers' cached steps,
    whose rotary module grows and resets its own."""
    path = write_random_checkpoint(tmp_path, model_type="llama", num_blocks=2, hidden_size=64, num_heads=4, seed=2,
                                   initializer_range=0.15, max_position_embeddings=8,
                                   rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spans = [open_checkpoint(path).load_span(0, 2, torch.float32)]
    for mask in (None, MASK):
        assert_cached_steps_equal(reference, spans, IDS, mask, CHUNKS, 16)
        assert_cached_steps_equal(reference, spans, IDS[:, :6], mask, [(0, 5), (5, 1)], 16)  # reset below 8


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
@pytest.mark.parametrize("seq_len", [None, 12, 64])
def test_rope_frequencies_are_transformers_to_the_bit(rope_type, seq_len):
    """Every type's frequencies; dynamic's at, below and past its trained length of 16, computed from a tensor
    length as a step computes them (on the device: RotaryFrequencies.dynamic_inv_freq)."""
    parameters = {"default": {}, "linear": {"factor": 2.0}, "dynamic": {"factor": 3.0},
                  "yarn": {"factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 16},
                  "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8}}[rope_type]
    config = LlamaConfig(hidden_size=96, num_attention_heads=3, max_position_embeddings=16,
                         rope_parameters={"rope_type": rope_type, "rope_theta": 500000.0, **parameters})
    rope = rope_frequencies(config, 32)
    ours, scaling = rope.inv_freq()
    if rope_type == "dynamic" and seq_len is not None:
        ours = rope.dynamic_inv_freq(torch.tensor(seq_len))
    compute = ROPE_INIT_FUNCTIONS.get(rope_type)
    if compute is None:  # default: transformers keeps it on the rotary module
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        theirs, their_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        grown = seq_len is not None and seq_len > config.max_position_embeddings  # as transformers calls it
        theirs, their_scaling = compute(config, None, seq_len=torch.tensor(seq_len) if grown else None)
    assert torch.equal(ours, theirs) and scaling == their_scaling


def test_configs_bloompeer_cannot_compute_exactly_are_refused():
    for fields in [dict(hidden_act="gelu"), dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                                   "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
                   dict(num_key_value_heads=3)]:
        with pytest.raises(ValueError):
            LlamaSpan.check_config(LlamaConfig(hidden_size=64, num_attention_heads=4, **fields))
