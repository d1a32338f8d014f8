"""A gpt-oss checkpoint with its experts in MXFP4, as the hub ships gpt-oss (tests never download):
written from a float checkpoint by rounding each group of 32 expert weights to 4-bit E2M1 values
under one power-of-two scale (bloompeer/blocks/published_formats.py reads it back)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["write_mxfp4_checkpoint"]

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # [E, in, out]: stored transposed


def _quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., rows, columns] -> (blocks uint8 [..., rows, columns / 32, 16], scales uint8 [..., rows, columns / 32])."""
    groups = weight.float().unflatten(-1, (-1, 32))
    largest = groups.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-126)
    exponents = torch.ceil(torch.log2(largest / 6.0))  # values / 2^e within E2M1's +-6
    codes = (groups / torch.exp2(exponents))[..., None].sub(FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponents.squeeze(-1) + 127).to(torch.uint8)


def write_mxfp4_checkpoint(float_checkpoint: Path, directory: Path) -> Path:
    """A copy of a gpt-oss checkpoint (its tokenizer too) with every block's fused expert weights in MXFP4."""
    shutil.copytree(float_checkpoint, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for shard in sorted(float_checkpoint.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    for name in [name for name in tensors if name.endswith(EXPERT_TENSORS)]:
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = _quantized(tensors.pop(name).transpose(-2, -1))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
