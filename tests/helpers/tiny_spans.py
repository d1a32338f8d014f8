"""Spans of the tests' tiny configs with random weights, built in memory (no checkpoint written): for tests that
compare one way of computing a span with another of the same weights, not with transformers."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from bloompeer.blocks import BlockSpan
from bloompeer.blocks.families import family_for_model_type

HIDDEN = 64


def random_span(model_type: str, fields: dict, start: int, end: int, seed: int = 0, device: str = "cpu",
                num_blocks: int = 4) -> BlockSpan:
    """Blocks [start, end) of a `num_blocks`-block model of `model_type` (hidden 64, 4 heads, fields as in
    tests/conftest.py's families) with weights drawn from N(0, 0.15^2), in float32 on `device`."""
    common = dict(vocab_size=100, hidden_size=HIDDEN, num_hidden_layers=num_blocks, num_attention_heads=4,
                  pad_token_id=0)
    if model_type != "bloom":
        common.update(num_key_value_heads=4 if model_type == "deepseek_v3" else 2, intermediate_size=3 * HIDDEN)
    config = AutoConfig.for_model(model_type, **(common | {k: v for k, v in fields.items() if k != "model_type"}))
    span = family_for_model_type(model_type).span_class(config, start, end).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in span.parameters():
            parameter.copy_(0.15 * torch.randn(parameter.shape, generator=generator))
    return span.to(device)
