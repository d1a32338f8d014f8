"""The hybrids' spans (blocks/qwen3_next.py: Gated DeltaNet blocks and gated-attention blocks, the
zero-centred RMSNorm, Qwen2-MoE's experts) against transformers' Qwen3NextForCausalLM on the same weights
in float32, and Qwen3.5's (its own DeltaNet projections, dense MLPs or every block sparse, multimodal
rotary) against Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM, read from published multimodal checkpoints:
a full forward, then a prompt and steps with each side's own cache (ours: keys and values for
the attention block, a recurrent state for the DeltaNet blocks), left-padded or not, shorter and longer
than the 64-token chunk, including a speculative-sized pass (ours runs it as one-token steps, transformers'
plain forward chunks it: within 1e-5)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from bloompeer.blocks import Segment, open_checkpoint
from bloompeer.blocks.qwen3_next import LinearAttentionBlock, Qwen3NextSpan
from bloompeer.blocks.kv_cache import SessionCache
from bloompeer.blocks.recurrent_state import RecurrentLayout, RewindError
from .transformers_checks import assert_cached_steps_equal, assert_full_forward_equal

LENGTHS = {12: [(0, 5), (5, 1), (6, 1), (7, 4), (11, 1)],  # a prompt within a chunk, steps, a speculative pass
           80: [(0, 70), (70, 1), (71, 1), (72, 7), (79, 1)]}  # a prompt across chunks


def _inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(3, 200, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[0, :3] = False  # row 0 left-padded
    return ids, mask


def _model(path) -> tuple:
    """(transformers' model, our spans 0:1 and 1:4)."""
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    checkpoint = open_checkpoint(path)
    return reference, [checkpoint.load_span(0, 1, torch.float32), checkpoint.load_span(1, 4, torch.float32)]


@pytest.fixture(scope="module")
def model(qwen3_next_checkpoint):
    return _model(qwen3_next_checkpoint)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def any_model(request, model, qwen3_5_checkpoints):
    """Each hybrid: Qwen3-Next's, and Qwen3.5's and Qwen3.5-MoE's text models (transformers' reference:
    Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, which AutoModelForCausalLM reads from the multimodal checkpoint)."""
    return model if request.param == "qwen3_next" else _model(qwen3_5_checkpoints[request.param])


def test_blocks_and_their_session_state_are_as_layer_types_say(any_model):
    reference, spans = any_model
    assert all(isinstance(span, Qwen3NextSpan) for span in spans)
    blocks = [block for span in spans for block in span.blocks]
    assert [isinstance(block, LinearAttentionBlock) for block in blocks] == [True, True, True, False]
    layouts = spans[1].cache_layouts(1, 4)
    assert [isinstance(layout, RecurrentLayout) for layout in layouts] == [True, True, False]
    cache = spans[1].new_cache(1, 4, 2, 16, torch.float32)
    assert cache.recurrent is not None and cache.keys.shape[0] == 1  # one block of keys, two of state


@torch.no_grad()
@pytest.mark.parametrize("length", sorted(LENGTHS))
def test_a_full_forward_equals_transformers(any_model, length):
    reference, spans = any_model
    ids, padded = _inputs(length)
    for mask in (None, padded):
        assert_full_forward_equal(reference, spans, ids, mask, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("length", sorted(LENGTHS))
def test_a_prompt_then_steps_equal_transformers_with_its_cache(any_model, length):
    reference, spans = any_model
    ids, padded = _inputs(length)
    for mask in (None, padded):
        assert_cached_steps_equal(reference, spans, ids, mask, LENGTHS[length], length)


def test_a_sessions_recurrent_state_is_a_cost_per_session(model):
    _, spans = model
    layouts = spans[1].cache_layouts(1, 4)
    per_session = SessionCache.nbytes_per_session(layouts, 2, torch.float32)
    assert per_session == 2 * layouts[0].nbytes(2, torch.float32) > 0  # blocks 1 and 2, whatever the length
    assert SessionCache.nbytes_per_token(layouts, torch.float32) == layouts[2].nbytes_per_token(torch.float32) + 1
    for length in (16, 1024):
        assert spans[1].cache_nbytes(1, 4, 2, length, torch.float32) == \
            2 * length * SessionCache.nbytes_per_token(layouts, torch.float32) + per_session


@torch.no_grad()
def test_rejected_drafts_roll_back_to_the_accepted_tokens_state(any_model):
    """A speculative pass of 4 tokens of which 2 are accepted, then a step from there: the step equals the
    same session sent only the accepted tokens; a rewind before the last pass is refused, changing nothing."""
    reference, spans = any_model
    ids, mask = _inputs(12)
    embedded = reference.model.embed_tokens(ids)

    def run(steps):
        caches = [span.new_cache(span.start, span.end, 2, 12, torch.float32) for span in spans]
        for position, num_new in steps:
            hidden = embedded[:, position:position + num_new]
            for span, cache in zip(spans, caches):
                hidden = span(hidden, cache.begin_step(position, mask[:, position:position + num_new], num_new), cache)
        return hidden, caches

    rolled_back, caches = run([(0, 7), (7, 4), (9, 1)])
    plain, _ = run([(0, 7), (7, 2), (9, 1)])
    torch.testing.assert_close(rolled_back, plain, rtol=0, atol=1e-5)  # projections of 4 rows and of 2 round apart
    length = caches[1].length
    with pytest.raises(RewindError):
        caches[1].begin_step(3, mask[:, 3:4], 1)
    assert caches[1].length == length and caches[1].recurrent.length == length


@torch.no_grad()
def test_sessions_batched_in_one_pass_each_step_from_their_own_state(any_model):
    """Three sessions (one left-padded) at different lengths share every pass: each one's outputs equal its
    steps alone (within float32 rounding: shared linear layers), its state its own."""
    _, spans = any_model
    span = spans[1]
    torch.manual_seed(1)
    lengths = (6, 3, 9)
    hidden = [torch.randn(1, length + 2, span.config.hidden_size) for length in lengths]
    masks = [None, torch.tensor([[False, True, True, True, True]]), None]

    def run(indices, caches):
        """Each session's prompt, then two steps, with sessions `indices` together in each pass."""
        outputs = {}
        for step in range(3):
            segments = []
            for index in indices:
                position, num_new = (0, lengths[index]) if step == 0 else (lengths[index] + step - 1, 1)
                mask = masks[index][:, position:position + num_new] if masks[index] is not None else None
                padding = caches[index].begin_step(position, mask, num_new)
                segments.append(Segment(hidden[index][:, position:position + num_new], padding, caches[index]))
            for index, output in zip(indices, span.forward_segments(segments)):
                outputs.setdefault(index, []).append(output)
        return outputs

    def new_caches():
        return [span.new_cache(1, 4, 1, 16, torch.float32) for _ in lengths]

    together = run([0, 1, 2], new_caches())
    for index in range(3):
        alone = run([index], new_caches())[index]
        for mine, theirs in zip(together[index], alone):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_pass_that_fails_after_the_deltanet_blocks_can_be_sent_again(model, monkeypatch):
    """A step that fails in the attention block, after the DeltaNet blocks advanced their states: with the
    session's length restored (what the scheduler does), the same step sent again gives a clean run's output."""
    _, spans = model
    span = spans[1]
    torch.manual_seed(2)
    hidden = torch.randn(1, 7, span.config.hidden_size)

    def run(cache, position, num_new):
        return span(hidden[:, position:position + num_new], cache.begin_step(position, None, num_new), cache)

    clean = span.new_cache(1, 4, 1, 16, torch.float32)
    run(clean, 0, 5)
    expected = run(clean, 5, 2)
    cache = span.new_cache(1, 4, 1, 16, torch.float32)
    run(cache, 0, 5)
    block_forward = type(span).block_forward

    def failing(self, block, *args):
        if not isinstance(block, LinearAttentionBlock):
            raise RuntimeError("the attention block failed")
        return block_forward(self, block, *args)

    monkeypatch.setattr(type(span), "block_forward", failing)
    with pytest.raises(RuntimeError):
        run(cache, 5, 2)
    monkeypatch.setattr(type(span), "block_forward", block_forward)
    cache.restore_length(5)
    with pytest.raises(RewindError):  # the failed tokens never happened: no step may follow them
        cache.begin_step(7, None, 1)
    torch.testing.assert_close(run(cache, 5, 2), expected, rtol=0, atol=0)
