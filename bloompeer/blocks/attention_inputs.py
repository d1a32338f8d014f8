"""What every attention block of the Llama family needs of a segment before it computes, made once per pass
rather than once per block: each session's rotation (cos/sin from its own positions, rope.py) and its key
biases (padding, causality and each sliding window, attention.py), and for a pass of several segments the
rotation of all their rows at once. The Llama span's attention, latent attention (mla.py) and the hybrid
spans (qwen3_next.py, which add their recurrent part) read these."""

from __future__ import annotations

import torch

from .attention import as_key_bias
from .rope import RotaryFrequencies
from .span import Segment

__all__ = ["AttentionInputs", "PassAttention"]


class AttentionInputs:
    """Per-segment inputs of every block's attention: rotation cos/sin, and the key biases by window."""

    def __init__(self, segment: Segment, rope: RotaryFrequencies, windows: set[int | None]):
        batch, num_new, _ = segment.hidden.shape
        cache = segment.cache
        positions = segment.new_positions()  # [batch, num_new]
        seen_length = None
        if rope.rope_type == "dynamic":  # on the device: a static step reads nothing back (step_graphs.py)
            seen_length = positions.amax() + 1
            if cache is not None:
                seen_length = rope.dynamic_length(cache.rope_length, seen_length)
                cache.rope_length.copy_(seen_length)
        cos, sin = rope.cos_sin(positions, segment.hidden.dtype, seen_length)
        self.batch, self.num_new, self.cache = batch, num_new, cache
        self.cos, self.sin = cos[:, :, None], sin[:, :, None]  # [batch, num_new, 1, head_dim]: broadcast over heads
        self.key_bias = {window: as_key_bias(segment.allowed_keys(window), segment.hidden.dtype)
                         for window in windows}


class PassAttention(list):
    """Every segment's AttentionInputs, with the rotation of all the pass's rows at once: one segment's
    cos/sin as they are, several segments' joined into [rows, 1, head_dim] (made once per pass), so that
    q/k norms and rotation run once per block rather than once per segment and block."""

    def __init__(self, inputs: list[AttentionInputs]):
        super().__init__(inputs)
        if len(inputs) == 1:
            self.cos, self.sin = inputs[0].cos, inputs[0].sin
        else:
            self.cos = torch.cat([segment.cos.flatten(0, 1) for segment in inputs])
            self.sin = torch.cat([segment.sin.flatten(0, 1) for segment in inputs])
