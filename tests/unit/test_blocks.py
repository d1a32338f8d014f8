"""BlockSpan and SessionCache against transformers' BloomModel on the same weights."""

import shutil

import pytest
import torch

from bloompeer.blocks import open_checkpoint
from bloompeer.blocks.bloom import BLOOM, BloomSpan

IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


def _embed(reference, ids):
    return reference.transformer.word_embeddings_layernorm(reference.transformer.word_embeddings(ids))


def _logits(reference, hidden):
    return reference.lm_head(reference.transformer.ln_f(hidden))


@pytest.fixture(scope="module")
def spans(tiny_checkpoint):
    checkpoint = open_checkpoint(tiny_checkpoint)
    return checkpoint.load_span(0, 1, torch.float32), checkpoint.load_span(1, 4, torch.float32)


@torch.no_grad()
def test_full_forward_equals_hf(spans, reference_model):
    expected = reference_model(IDS, attention_mask=MASK).logits
    hidden = _embed(reference_model, IDS)
    for span in spans:
        hidden = span(hidden, MASK.bool())
    real = MASK.bool()
    torch.testing.assert_close(_logits(reference_model, hidden)[real], expected[real], rtol=0, atol=1e-5)


@torch.no_grad()
def test_incremental_steps_with_cache_equal_hf(spans, reference_model, tiny_checkpoint):
    config = open_checkpoint(tiny_checkpoint).config()
    expected = reference_model(IDS, attention_mask=MASK).logits
    hidden = _embed(reference_model, IDS)
    caches = [span.new_cache(span.start, span.end, batch=2, max_length=16, dtype=torch.float32)
              for span in spans]
    outputs = []
    for position, num_new in [(0, 4), (4, 1), (5, 2)]:
        step = hidden[:, position:position + num_new]
        for span, cache in zip(spans, caches):
            step = span(step, cache.begin_step(position, MASK[:, position:position + num_new].bool(), num_new), cache)
        outputs.append(step)
    real = MASK.bool()
    torch.testing.assert_close(_logits(reference_model, torch.cat(outputs, 1))[real], expected[real],
                               rtol=0, atol=1e-5)


@torch.no_grad()
def test_rewind_and_reorder(spans, tiny_checkpoint):
    """Replaying from an earlier position, or reordering rows, gives what a fresh cache would."""
    config = open_checkpoint(tiny_checkpoint).config()
    span = spans[1]
    hidden = torch.randn(2, 5, config.hidden_size)
    cache = span.new_cache(span.start, span.end, batch=2, max_length=8, dtype=torch.float32)
    span(hidden[:, :3], cache.begin_step(0, None, 3), cache)
    span(torch.randn(2, 2, config.hidden_size), cache.begin_step(3, None, 2), cache)  # to be overwritten
    rewound = span(hidden[:, 3:], cache.begin_step(3, None, 2), cache)
    fresh = span(hidden, None)
    torch.testing.assert_close(rewound, fresh[:, 3:], rtol=0, atol=1e-5)
    cache.reorder(torch.tensor([1, 1]))
    last = torch.randn(1, 1, config.hidden_size).expand(2, 1, -1)
    reordered = span(last, cache.begin_step(5, None, 1), cache)
    torch.testing.assert_close(reordered[0], reordered[1])
    expected_row = span(torch.cat([hidden[1:], last[1:]], 1), None)[:, -1]
    torch.testing.assert_close(reordered[:, 0], expected_row.expand(2, -1), rtol=0, atol=1e-5)


def test_loading_reads_only_the_shards_of_its_blocks(tiny_checkpoint, tmp_path, reference_model):
    """A server of blocks 2:4 works with every other shard deleted from its copy of the checkpoint."""
    checkpoint = open_checkpoint(tiny_checkpoint)
    weight_map = checkpoint.weight_map()
    needed = {shard for name, shard in weight_map.items() if name.startswith((BLOOM.block_prefix(2), BLOOM.block_prefix(3)))}
    assert len(set(weight_map.values()) - needed) >= 2, "the fixture must shard the checkpoint finely"
    for path in tiny_checkpoint.iterdir():
        if path.suffix != ".safetensors" or path.name in needed:
            shutil.copy(path, tmp_path / path.name)
    span = open_checkpoint(tmp_path).load_span(2, 4, torch.float32)
    for offset, block in enumerate(span.blocks):
        reference = reference_model.transformer.h[2 + offset].state_dict()
        for name, tensor in block.state_dict().items():
            assert torch.equal(tensor, reference[name]), name
    with pytest.raises(Exception):  # and the deleted shards really were needed by other blocks
        open_checkpoint(tmp_path).load_span(0, 1, torch.float32)


def test_span_refuses_ranges_outside_the_model(tiny_checkpoint):
    config = open_checkpoint(tiny_checkpoint).config()
    for start, end in [(0, 0), (3, 2), (0, 5), (-1, 2)]:
        with pytest.raises(ValueError):
            BloomSpan(config, start, end)


@torch.no_grad()
def test_one_request_alone_is_bitwise_hf(spans, reference_model):
    """Written out op for op as HF's BloomBlock: not close, equal."""
    hidden = _embed(reference_model, IDS)
    expected = reference_model(IDS, attention_mask=MASK, output_hidden_states=True).hidden_states
    torch.testing.assert_close(spans[0](hidden, MASK.bool()), expected[1], rtol=0, atol=0)


@pytest.fixture(scope="module")
def span_with_batched_linears(tiny_checkpoint):
    span = open_checkpoint(tiny_checkpoint).load_span(1, 4, torch.float32)
    assert span.use_batched_linears() and span.batched_linears is not None
    return span


@torch.no_grad()
def test_a_request_alone_stays_bitwise_hf_with_batched_linears_kept(tiny_checkpoint, reference_model):
    span = open_checkpoint(tiny_checkpoint).load_span(0, 3, torch.float32)
    span.use_batched_linears()
    expected = reference_model(IDS, attention_mask=MASK, output_hidden_states=True).hidden_states
    hidden = span(_embed(reference_model, IDS), MASK.bool())
    torch.testing.assert_close(hidden, expected[3], rtol=0, atol=0)  # [4] is after the final layer norm


@pytest.mark.parametrize("batched_linears", [False, True], ids=["mkl", "batched-linears"])
@torch.no_grad()
def test_batched_segments_equal_separate_requests(spans, span_with_batched_linears, tiny_checkpoint,
                                                  batched_linears, monkeypatch):
    """Steps of three sessions (different lengths, padding, prefill and decode, deep prompts in
    one) in one pass; with batched linears kept, that pass's linear layers are oneDNN's."""
    from bloompeer.blocks import Segment
    from bloompeer.blocks.batched_linear import BatchedLinears

    config = open_checkpoint(tiny_checkpoint).config()
    span = span_with_batched_linears if batched_linears else spans[1]
    calls = []
    linear = BatchedLinears.__call__
    monkeypatch.setattr(BatchedLinears, "__call__", lambda self, *args: calls.append(1) or linear(self, *args))
    torch.manual_seed(0)
    shapes = [(2, 5), (1, 1), (3, 2)]  # (batch, new tokens) per session
    prefixes = [0, 7, 3]  # tokens each session has cached already

    def sessions():
        caches, steps = [], []
        for (batch, num_new), cached in zip(shapes, prefixes):
            cache = span.new_cache(span.start, span.end, batch, 16, torch.float32)
            if cached:
                span(torch.randn(batch, cached, config.hidden_size), cache.begin_step(0, None, cached), cache)
            caches.append(cache)
            mask = torch.ones(batch, num_new, dtype=torch.bool)
            mask[0, 0] = num_new == 1 or cached > 0  # some padding in one session's new tokens
            prompts = torch.randn(span.num_blocks, batch, 3, config.hidden_size) if num_new >= 3 else None
            steps.append((torch.randn(batch, num_new, config.hidden_size), mask, prompts))
        return caches, steps

    torch.manual_seed(1)
    caches, steps = sessions()
    separate = [span(h, c.begin_step(c.length, m, h.shape[1]), c, prompts=p) for c, (h, m, p) in zip(caches, steps)]
    torch.manual_seed(1)
    caches, steps = sessions()
    segments = [Segment(h, c.begin_step(c.length, m, h.shape[1]), c, p) for c, (h, m, p) in zip(caches, steps)]
    batched = span.forward_segments(segments)
    for one, many in zip(separate, batched):
        torch.testing.assert_close(many, one, rtol=0, atol=1e-5)
    assert len(calls) == (4 * span.num_blocks if batched_linears else 0)  # only the batched pass used them


def test_layers_hold_the_parameters_of_hfs_block(tiny_checkpoint):
    from transformers.models.bloom.modeling_bloom import BloomBlock

    from bloompeer.blocks.bloom import BloomBlock as OurBlock

    config = open_checkpoint(tiny_checkpoint).config()
    ours = {name: tuple(p.shape) for name, p in OurBlock(config, 0).named_parameters()}
    theirs = {name: tuple(p.shape) for name, p in BloomBlock(config, layer_idx=0).named_parameters()}
    assert ours == theirs


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 8, 12, 16, 20])
def test_alibi_bias_is_hfs_to_the_bit(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from bloompeer.blocks.bloom import alibi_bias

    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(alibi_bias(MASK, num_heads, dtype), build_alibi_tensor(MASK, num_heads, dtype))


def test_gelu_is_hfs_to_the_bit_and_its_gradient_too():
    from transformers.models.bloom.modeling_bloom import BloomGelu

    from bloompeer.blocks.bloom import bloom_gelu

    torch.manual_seed(0)
    x = (torch.randn(4096) * 4).requires_grad_()
    grad = torch.randn(4096)
    ours, theirs = bloom_gelu(x), BloomGelu()(x)
    assert torch.equal(ours, theirs)
    (our_grad,), (their_grad,) = torch.autograd.grad(ours, x, grad), torch.autograd.grad(theirs, x, grad)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-6, atol=1e-7)
