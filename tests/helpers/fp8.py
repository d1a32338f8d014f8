"""A checkpoint with its blocks' linear layers in FP8, as DeepSeek publishes DeepSeek-V3 (tests never
download): written from a float checkpoint by scaling each block of BLOCK weights into float8_e4m3fn's
range (its largest value to 448) and storing the scale as weight_scale_inv (bloompeer/blocks/
published_formats.py reads it back, and so does transformers' FineGrainedFP8 dequantization)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["write_fp8_checkpoint"]

FP8_MAX = 448.0  # float8_e4m3fn's largest value


def _quantized(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [rows, columns] (multiples of block) -> (codes float8_e4m3fn, scale_inv float32 [rows / b0, columns / b1])."""
    blocks = weight.float().unflatten(0, (-1, block[0])).unflatten(-1, (-1, block[1]))  # [R, b0, C, b1]
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # [R, C]
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return codes.flatten(2).flatten(0, 1), scale.contiguous()


def write_fp8_checkpoint(float_checkpoint: Path, directory: Path, block: tuple[int, int] = (8, 8)) -> Path:
    """A copy of a checkpoint (its tokenizer too) with every linear weight of its blocks in FP8 (the routers
    `mlp.gate.weight`, norms, embeddings and LM head as they were), in one file."""
    shutil.copytree(float_checkpoint, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for shard in sorted(float_checkpoint.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    for name in [name for name, tensor in tensors.items() if name.startswith("model.layers.")
                 and name.endswith("proj.weight") and tensor.ndim == 2]:
        tensors[name], tensors[f"{name}_scale_inv"] = _quantized(tensors[name], block)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
