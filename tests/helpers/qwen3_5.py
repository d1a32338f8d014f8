"""Qwen3.5 checkpoints as Qwen publishes them (tests never download): a multimodal `qwen3_5` or `qwen3_5_moe`
config whose `text_config` is the text model's (`qwen3_5_text`, `qwen3_5_moe_text`), the text model's tensors
under `model.language_model.*`, its head at `lm_head.weight`, a vision tower beside them (`model.visual.*`),
written by transformers' own multimodal class from a config with random weights (its save_pretrained writes
that layout: the experts one by one, `mlp.experts.{j}.gate_proj.weight`, ...)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from bloompeer.peer.cli.default_model import write_byte_tokenizer

__all__ = ["QWEN3_5_TEXT", "write_qwen3_5_checkpoint"]

# A tiny text model of each (4 blocks: three Gated DeltaNet, one gated attention), multimodal rotary as published
# (partial, mrope_section over the rotated half's 4 frequencies, interleaved)
_COMMON = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4,
               rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                    mrope_section=[2, 1, 1], mrope_interleaved=True))
QWEN3_5_TEXT = {
    "qwen3_5": _COMMON,
    "qwen3_5_moe": dict(_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=64),
}
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=16)


def write_qwen3_5_checkpoint(directory: Path, model_type: str, *, num_blocks: int = 4, hidden_size: int = 64,
                             num_heads: int = 4, seed: int = 8, initializer_range: float = 0.15) -> Path:
    """A tiny `model_type` ("qwen3_5", "qwen3_5_moe") checkpoint of QWEN3_5_TEXT's text model with a byte-level
    tokenizer, an untied head, and random norm weights, decays and dt biases (transformers initializes the norms
    to zeros: (1 + w) would be 1 everywhere)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = write_byte_tokenizer(directory)
    text = dict(QWEN3_5_TEXT[model_type], model_type=f"{model_type}_text", vocab_size=vocab_size,
                hidden_size=hidden_size, num_hidden_layers=num_blocks, num_attention_heads=num_heads,
                num_key_value_heads=num_heads // 2, intermediate_size=3 * hidden_size, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, initializer_range=initializer_range, tie_word_embeddings=False)
    vision = dict(TINY_VISION, out_hidden_size=hidden_size)
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.model.language_model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(directory)
    return directory
