"""Weights as their authors publish them, read into the served dtype as a block loads.

gpt-oss ships its experts in MXFP4 (the OCP microscaling format, `quantization_config.quant_method`
"mxfp4"): each tensor X is stored as `X_blocks`, uint8 [..., rows, groups, 16] holding two 4-bit
E2M1 values a byte (the even element in the low nibble), and `X_scales`, uint8 [..., rows, groups],
one power of two (exponent + 127) for each group of 32 values along the last dimension. Dequantized,
X is [..., groups * 32, rows]: transposed, as transformers lays out gpt-oss's fused experts
(`integrations/mxfp4.py`, whose arithmetic this is: every value is exact in float32 and bfloat16).
The rest of the checkpoint (attention, router, norms, embeddings) is stored as usual.

DeepSeek-V3 (and Kimi K2) ship their linear layers in FP8 (`quant_method` "fp8"): each weight X.weight
as float8_e4m3fn [rows, columns] and X.weight_scale_inv, float32 [ceil(rows / b0), ceil(columns / b1)],
one scale per block of `weight_block_size` [b0, b1] ([128, 128]); X = codes x scale, multiplied in
float32 and cast to the dtype, as transformers' Fp8Dequantize computes it (bitwise). Routers, norms,
biases, embeddings and the LM head are stored as usual.

Kimi K2-Thinking and K2.5 ship their routed experts in INT4 (`quant_method` "compressed-tensors", format
"pack-quantized"): pack_quantized.py reads them.
"""

from __future__ import annotations

import torch

from .pack_quantized import STORED_SUFFIXES, PackQuantized

__all__ = ["dequantize_published", "is_stored_packed", "kept_as_stored"]

# The 16 values of a 4-bit E2M1 code, by code (the sign is its top bit)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"
_SCALE_INV = "_scale_inv"  # FP8's: X.weight_scale_inv beside X.weight
_PACKED_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def is_stored_packed(tensor: torch.Tensor) -> bool:
    """A tensor whose stored bytes are a format's codes, not values in a float dtype: left as stored."""
    return tensor.dtype in _PACKED_DTYPES


def kept_as_stored(name: str, tensor: torch.Tensor) -> bool:
    """What a loader must not cast to the served dtype: a format's codes, FP8's float32 scales, and
    compressed-tensors' int32 codes, scales and shapes."""
    return is_stored_packed(tensor) or name.endswith((_SCALE_INV, *STORED_SUFFIXES))


def dequantize_published(state: dict[str, torch.Tensor], quantization_config: dict | None,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A block's tensors as stored -> every one in `dtype`, as config.json's quantization_config says they
    are stored. ValueError for a format not read here."""
    quant_method = (quantization_config or {}).get("quant_method")
    if quant_method == "mxfp4":
        state = _mxfp4_pairs_dequantized(state, dtype)
    elif quant_method == "fp8":
        state = _fp8_pairs_dequantized(state, tuple(quantization_config.get("weight_block_size") or (128, 128)), dtype)
    elif quant_method == "compressed-tensors":
        state = PackQuantized.of(quantization_config).dequantized(state, dtype)
    elif quant_method is not None:
        raise ValueError(f"weights published as {quant_method!r} are not read by bloompeer (it reads mxfp4, fp8, "
                         f"compressed-tensors pack-quantized)")
    packed = sorted(name for name, tensor in state.items() if is_stored_packed(tensor))
    if packed:
        raise ValueError(f"tensors stored as codes of a format this checkpoint's config does not name: {packed[:3]}")
    return state


def _mxfp4_pairs_dequantized(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    for name in [name for name in state if name.endswith(_BLOCKS)]:
        base = name.removesuffix(_BLOCKS)
        if base + _SCALES not in state:
            raise ValueError(f"{name} has no {base + _SCALES}")
        state[base] = _mxfp4(state.pop(name), state.pop(base + _SCALES), dtype)
    return state


def _fp8_pairs_dequantized(state: dict[str, torch.Tensor], block: tuple[int, ...],
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    for name in [name for name in state if name.endswith(_SCALE_INV)]:
        weight = name.removesuffix(_SCALE_INV)
        if weight not in state:
            raise ValueError(f"{name} has no {weight}")
        state[weight] = _fp8(state.pop(weight), state.pop(name), block, dtype)
    return state


def _fp8(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """codes float8_e4m3fn [rows, columns], scale_inv [ceil(rows / b0), ceil(columns / b1)] -> [rows, columns]."""
    rows, columns = codes.shape
    grid = (-(-rows // block[0]), -(-columns // block[1]))
    if codes.dtype != torch.float8_e4m3fn or len(block) != 2 or tuple(scale_inv.shape) != grid:
        raise ValueError(f"FP8 weight {codes.dtype} {tuple(codes.shape)} does not fit its scales "
                         f"{tuple(scale_inv.shape)} in blocks of {list(block)}")
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return (codes.float() * scales).to(dtype)


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., rows, groups, 16], scales uint8 [..., rows, groups] -> [..., groups * 32, rows]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    values = torch.tensor(_FP4_VALUES, dtype=dtype)
    codes = blocks.to(torch.int64)
    out = torch.empty(*blocks.shape[:-1], 32, dtype=dtype)
    out[..., 0::2] = values[codes & 0x0F]
    out[..., 1::2] = values[codes >> 4]
    torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None], out=out)
    return out.flatten(-2).transpose(-2, -1).contiguous()
