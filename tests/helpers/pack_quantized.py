"""A checkpoint with its routed experts in INT4 as Moonshot publishes Kimi K2-Thinking and K2.5 (tests never
download): compressed-tensors' "pack-quantized" format, written from a float checkpoint with the package's own
`pack_to_int32` (its codes as the package stores them), one bfloat16 scale per group of 32 inputs (the largest
value of a group to 7, as Kimi's quantization-aware training leaves it: codes -7..7), and Kimi's
quantization_config with its `ignore` list (attention, shared experts, dense layers, the head: kept as they are).
A multimodal checkpoint (Kimi K2.5's) gets the config inside its text_config, where Moonshot puts it.
bloompeer/blocks/pack_quantized.py reads it back; `reference_weight` is the package's own dequantization, and
`write_dequantized_checkpoint` writes it as a float checkpoint that transformers loads as usual (transformers' own
compressed-tensors loading does not reach DeepSeek-V3's fused experts: it would leave them uninitialized)."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["KIMI_INT4", "reference_weight", "write_dequantized_checkpoint", "write_pack_quantized_checkpoint"]

# Kimi K2-Thinking's quantization_config (its config.json, as published)
KIMI_INT4 = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def _packed(weight: torch.Tensor, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """weight [rows, columns] -> the tensors compressed-tensors stores for it (by suffix)."""
    top = 2 ** (bits - 1) - 1  # 7 for 4 bits
    groups = weight.float().unflatten(-1, (-1, group_size))  # [rows, groups, group_size]
    scale = (groups.abs().amax(-1) / top).clamp_min(1e-8).to(torch.bfloat16)  # [rows, groups]
    codes = (groups / scale.float()[..., None]).round().clamp(-top - 1, top).to(torch.int8).flatten(1)
    return {"weight_packed": pack_to_int32(codes, bits), "weight_scale": scale,
            "weight_shape": torch.tensor(weight.shape)}


def reference_weight(tensors: dict[str, torch.Tensor], module: str, quantization_config: dict,
                     dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' own dequantization of `module`'s stored tensors into `dtype`: its product in the scale's
    dtype, the scale held in `dtype` (as transformers' loading holds it)."""
    args = QuantizationArgs(**quantization_config["config_groups"]["group_0"]["weights"])
    shape = tensors[f"{module}.weight_shape"]
    codes = unpack_from_int32(tensors[f"{module}.weight_packed"], args.num_bits, torch.Size(shape.tolist()))
    return dequantize(codes, tensors[f"{module}.weight_scale"].to(dtype), args=args, dtype=dtype)


def write_pack_quantized_checkpoint(float_checkpoint: Path, directory: Path,
                                    quantization_config: dict = KIMI_INT4) -> Path:
    """A copy of a checkpoint (its tokenizer too) with every routed expert's linear weights pack-quantized as
    `quantization_config` says (its one group's num_bits and group_size), sharded over files of about 100 KB with
    their index, as published checkpoints are."""
    shutil.copytree(float_checkpoint, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for shard in sorted(float_checkpoint.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    weights = quantization_config["config_groups"]["group_0"]["weights"]
    for name in [name for name in tensors if ROUTED_EXPERT.fullmatch(name)]:
        module = name.removesuffix(".weight")
        packed = _packed(tensors.pop(name), weights["num_bits"], weights["group_size"])
        tensors |= {f"{module}.{suffix}": tensor for suffix, tensor in packed.items()}
    _save_sharded(tensors, directory, 100_000)
    config = json.loads((float_checkpoint / "config.json").read_text())
    (config["text_config"] if "text_config" in config else config)["quantization_config"] = \
        copy.deepcopy(quantization_config)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_dequantized_checkpoint(int4_checkpoint: Path, directory: Path) -> Path:
    """A copy of a pack-quantized checkpoint with every packed weight as compressed-tensors dequantizes it in
    float32, in one file, without its quantization_config."""
    shutil.copytree(int4_checkpoint, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    config = json.loads((int4_checkpoint / "config.json").read_text())
    quantization_config = (config["text_config"] if "text_config" in config else config).pop("quantization_config")
    tensors = {}
    for shard in sorted(int4_checkpoint.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    for module in [name.removesuffix(".weight_packed") for name in tensors if name.endswith(".weight_packed")]:
        tensors[f"{module}.weight"] = reference_weight(tensors, module, quantization_config, torch.float32)
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            del tensors[f"{module}.{suffix}"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _save_sharded(tensors: dict[str, torch.Tensor], directory: Path, shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name in sorted(tensors):
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensors[name].nbytes > shard_bytes:
            shards.append({})
        shards[-1][name] = tensors[name].contiguous()
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / filename, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, filename)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
