"""The checks every family's block tests make against transformers' own model on the same weights: a full
forward, and a prompt then steps against its DynamicCache. `spans` cover the model's blocks in order; `mask`
is a left-padding mask ([batch, length] bool) or None."""

import torch
from transformers import DynamicCache


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as transformers' generate derives them from the attention mask."""
    return (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)


def assert_full_forward_equal(reference, spans, ids: torch.Tensor, mask: torch.Tensor | None, atol: float) -> None:
    """Our spans' last hidden states (after the final norm) at the real tokens, within `atol` of transformers'."""
    positions = None if mask is None else generate_positions(mask)
    expected = reference.model(ids, attention_mask=mask, position_ids=positions).last_hidden_state
    hidden = reference.model.embed_tokens(ids)
    for span in spans:
        hidden = span(hidden, mask)
    real = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask
    torch.testing.assert_close(reference.model.norm(hidden)[real], expected[real], rtol=0, atol=atol)


def assert_cached_steps_equal(reference, spans, ids: torch.Tensor, mask: torch.Tensor | None,
                              chunks: list[tuple[int, int]], max_length: int, atol: float = 1e-5) -> None:
    """`chunks` ((position, new tokens) in order: a prompt, then steps) through our session caches and through
    transformers' DynamicCache: logits at the real tokens within `atol`, chunk by chunk."""
    theirs = DynamicCache(config=reference.config)
    caches = [span.new_cache(span.start, span.end, ids.shape[0], max_length, torch.float32) for span in spans]
    embedded = reference.model.embed_tokens(ids)
    for position, num_new in chunks:
        new = slice(position, position + num_new)
        attention = None if mask is None else mask[:, :new.stop]
        positions = None if mask is None else generate_positions(attention)[:, new]
        expected = reference(ids[:, new], attention_mask=attention, position_ids=positions, cache=theirs,
                             use_cache=True).logits
        hidden = embedded[:, new]
        for span, cache in zip(spans, caches):
            hidden = span(hidden, cache.begin_step(position, None if mask is None else mask[:, new], num_new), cache)
        real = torch.ones(ids.shape[0], num_new, dtype=torch.bool) if mask is None else mask[:, new]
        logits = reference.lm_head(reference.model.norm(hidden))
        torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=atol)
