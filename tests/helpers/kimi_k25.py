"""A Kimi K2.5 checkpoint as Moonshot publishes it (tests never download): a multimodal `kimi_k25` config
whose `text_config` is DeepSeek-V3's (model type "kimi_k2", which transformers reads as deepseek_v3), the text
model's tensors under `language_model.model.*` and `language_model.lm_head`, a vision tower and projector
beside them (`vision_tower.*`, `mm_projector.*`), written from a config with random weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForImageTextToText

from bloompeer.peer.cli.default_model import write_byte_tokenizer

__all__ = ["write_kimi_k25_checkpoint"]

TINY_VISION = dict(patch_size=14, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def write_kimi_k25_checkpoint(directory: Path, text_fields: dict, *, num_blocks: int = 4, hidden_size: int = 64,
                              num_heads: int = 4, seed: int = 6, initializer_range: float = 0.15) -> Path:
    """A tiny Kimi K2.5 whose text model is a DeepSeek-V3 of `text_fields` (tests/conftest.py's DEEPSEEK_FAMILY),
    with a byte-level tokenizer and a random e_score_correction_bias (transformers initializes it to zeros)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = write_byte_tokenizer(directory)
    text = dict(text_fields, model_type="deepseek_v3", vocab_size=vocab_size, hidden_size=hidden_size,
                num_hidden_layers=num_blocks, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                intermediate_size=3 * hidden_size, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                initializer_range=initializer_range, tie_word_embeddings=False)
    config = AutoConfig.for_model("kimi_k25", text_config=text, vision_config=TINY_VISION, projection_hidden_size=32,
                                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.language_model.layers[text["first_k_dense_replace"]:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.1 * torch.randn(bias.shape, generator=generator))
    model.save_pretrained(directory)
    _published_names(directory / "model.safetensors")
    config_json = json.loads((directory / "config.json").read_text())
    config_json["architectures"] = ["KimiK25ForConditionalGeneration"]
    config_json["text_config"]["model_type"] = "kimi_k2"  # as published
    (directory / "config.json").write_text(json.dumps(config_json, indent=2))
    return directory


def _published_names(path: Path) -> None:
    """transformers saves its conversion mapping reversed, and the reverse of its vision-tower rename
    (blocks -> layers) renames the text model's layers too: put them back under `language_model.model.layers`,
    where the published checkpoint has them (and where transformers' loading finds them)."""
    with safe_open(path, framework="pt") as f:
        tensors = {name.replace("language_model.model.blocks.", "language_model.model.layers."): f.get_tensor(name)
                   for name in f.keys()}
    save_file(tensors, path, metadata={"format": "pt"})
