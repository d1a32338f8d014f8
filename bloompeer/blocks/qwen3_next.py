"""The hybrids, Qwen3-Next (`qwen3_next`) and Qwen3.5's text models (`qwen3_5_text`, `qwen3_5_moe_text`): the
Llama family with three of every four blocks' attention replaced by Gated DeltaNet (gated_deltanet.py), as
`layer_types` says, each block as transformers' Qwen3NextDecoderLayer / Qwen3_5DecoderLayer computes it.

Stated as its differences from the Llama family: its full-attention blocks are the Llama family's with
the `qwen3_next` variant below (Qwen3's, with a gated query, partial rotary, the zero-centred RMSNorm,
Qwen2-MoE's experts with a shared expert); a `linear_attention` block is the same block with
`linear_attn` where `self_attn` would be, which keeps a per-session state (its `RecurrentLayout`, kept
in the session cache's `recurrent`) rather than keys and values per token. The multi-token-prediction
head (`mtp.*`) is not a block: nobody reads it.

Qwen3.5 is Qwen3-Next with, read from transformers 5.25's modular_qwen3_5.py and modular_qwen3_5_moe.py:
- its Gated DeltaNet's projections apart and in plain order (`Qwen35GatedDeltaNet`);
- Qwen3.5 (dense): every block's MLP dense (Qwen3NextMLP: SwiGLU of intermediate_size);
- Qwen3.5-MoE: every block sparse (no decoder_sparse_step, no mlp_only_layers), Qwen3-Next's experts and
  shared expert, its router Qwen3-VL-MoE's, which always renormalizes the top k (no norm_topk_prob); its
  experts read stored expert by expert or stacked (moe.py split_stacked_experts);
- multimodal rotary (mrope: mrope_section, interleaved) that rotates a text token as plain partial rotary
  does: a text token's temporal, height and width positions are all its position, so every frequency
  sees that one position (transformers expands text position ids to the three axes alike).
Attention (Qwen3NextAttention), the zero-centred norms and the layer order are Qwen3-Next's. Its published
checkpoints are multimodal (families.py MULTIMODAL_CHECKPOINTS): servers read the text model's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from .attention_inputs import AttentionInputs, PassAttention
from .gated_deltanet import DeltaNetSegment, GatedDeltaNet, Qwen35GatedDeltaNet, recurrent_layout
from .kv_cache import Layout
from .moe import split_stacked_experts
from .llama import (
    LLAMA, LlamaSpan, Variant, client_modules, norm_of, qwen_experts_mlp, qwen_moe_experts, qwen_moe_mlp, variant_of,
)
from .span import Linear, Segment

__all__ = ["QWEN3_NEXT", "LinearAttentionBlock", "Qwen3NextSpan"]


def _qwen3_5_moe_experts(config, layer_idx: int) -> tuple[int, int]:
    """Qwen3.5-MoE: every layer routes to num_experts_per_tok of num_experts."""
    return config.num_experts, config.num_experts_per_tok


_VARIANTS = {
    # Qwen3's full attention with a gated query, partial rotary and the zero-centred norm; Qwen2-MoE's experts
    "qwen3_next": lambda c: replace(variant_of(c, "qwen3"), partial_rotary=True, zero_centred_norm=True,
                                    gated_query=True, experts=qwen_moe_experts,
                                    make_mlp=lambda config, i: qwen_moe_mlp(config, i, shared=True)),
}
_VARIANTS |= {  # Qwen3.5's text models, as Qwen3-Next's differences (the module's docstring)
    "qwen3_5_text": lambda c: replace(_VARIANTS["qwen3_next"](c), experts=None, make_mlp=None),
    "qwen3_5_moe_text": lambda c: replace(_VARIANTS["qwen3_next"](c), experts=_qwen3_5_moe_experts,
                                          make_mlp=lambda config, i: qwen_experts_mlp(config, True, renormalize=True),
                                          convert=lambda state: split_stacked_experts(state, "mlp.experts.")),
}
# each model type's Gated DeltaNet layer
_DELTANETS = {"qwen3_next": GatedDeltaNet, "qwen3_5_text": Qwen35GatedDeltaNet, "qwen3_5_moe_text": Qwen35GatedDeltaNet}


def is_linear(config, layer_idx: int) -> bool:
    return config.layer_types[layer_idx] == "linear_attention"


class LinearAttentionBlock(nn.Module):
    """A `linear_attention` block's parameters, named as in a checkpoint."""

    def __init__(self, config, variant, layer_idx: int, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = norm_of(variant, config.hidden_size, config.rms_norm_eps)
        self.linear_attn = _DELTANETS[config.model_type](config, layer_idx)
        self.post_attention_layernorm = norm_of(variant, config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    @property
    def feed_forward(self) -> nn.Module:
        return self.mlp


class _HybridInputs(AttentionInputs):
    """A segment's attention inputs, and its part of a Gated DeltaNet pass: its rows, its session's
    recurrent state and its new tokens' padding."""

    def __init__(self, segment: Segment, rope, windows):
        super().__init__(segment, rope, windows)
        mask = segment.padding_mask
        self.deltanet = DeltaNetSegment(self.batch, self.num_new, self.cache.recurrent if self.cache else None,
                                        None if mask is None else mask[:, -self.num_new:])


class Qwen3NextSpan(LlamaSpan):
    """Blocks [start, end) of a hybrid model (Qwen3-Next, Qwen3.5)."""

    @classmethod
    def variant_for(cls, config) -> Variant:
        return _VARIANTS[config.model_type](config)

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        kinds = set(config.layer_types) - {"linear_attention", "full_attention"}
        if kinds:
            raise ValueError(f"layer types {sorted(kinds)} are not served (the hybrids' are "
                             "linear_attention and full_attention)")

    def make_block(self, config, layer_idx: int) -> nn.Module:
        if not is_linear(config, layer_idx):
            return super().make_block(config, layer_idx)
        return LinearAttentionBlock(config, self.variant, layer_idx, self.make_mlp(config, layer_idx))

    @classmethod
    def cache_layout(cls, config, layer_idx: int) -> Layout:
        return recurrent_layout(config) if is_linear(config, layer_idx) else super().cache_layout(config, layer_idx)

    def attention_inputs(self, segment: Segment) -> _HybridInputs:
        return _HybridInputs(segment, self.rope, self._windows)

    def block_forward(self, block: nn.Module, hidden: torch.Tensor, attention: PassAttention,
                      rows: list[int], linear: Linear) -> torch.Tensor:
        """Qwen3NextDecoderLayer.forward: a linear block mixes with Gated DeltaNet, each segment from its own
        state; a full-attention block is the Llama family's."""
        if not isinstance(block, LinearAttentionBlock):
            return super().block_forward(block, hidden, attention, rows, linear)
        segments: Sequence[DeltaNetSegment] = [inputs.deltanet for inputs in attention]
        hidden = hidden + block.linear_attn.compute(block.input_layernorm(hidden), linear, segments)
        return hidden + block.feed_forward.compute(block.post_attention_layernorm(hidden), linear, rows)


QWEN3_NEXT = replace(
    LLAMA, name="qwen3_next", span_class=Qwen3NextSpan,
    config_classes={"qwen3_next": "Qwen3NextConfig", "qwen3_5_text": "Qwen3_5TextConfig",
                    "qwen3_5_moe_text": "Qwen3_5MoeTextConfig"},
    client=replace(LLAMA.client, class_name="Qwen3Next", pretrained_model="Qwen3NextPreTrainedModel",
                   make_modules=client_modules(Qwen3NextSpan)),
)
