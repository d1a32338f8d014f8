"""Weights as their authors publish them, read into the served dtype as a block loads.

gpt-oss ships its experts in MXFP4 (the OCP microscaling format, `quantization_config.quant_method`
"mxfp4"): each tensor X is stored as `X_blocks`, uint8 [..., rows, groups, 16] holding two 4-bit
E2M1 values a byte (the even element in the low nibble), and `X_scales`, uint8 [..., rows, groups],
one power of two (exponent + 127) for each group of 32 values along the last dimension. Dequantized,
X is [..., groups * 32, rows]: transposed, as transformers lays out gpt-oss's fused experts
(`integrations/mxfp4.py`, whose arithmetic this is: every value is exact in float32 and bfloat16).
The rest of the checkpoint (attention, router, norms, embeddings) is stored as usual.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_published", "is_stored_packed"]

# The 16 values of a 4-bit E2M1 code, by code (the sign is its top bit)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"
_PACKED_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def is_stored_packed(tensor: torch.Tensor) -> bool:
    """A tensor whose stored bytes are a format's codes, not values in a float dtype: left as stored."""
    return tensor.dtype in _PACKED_DTYPES


def dequantize_published(state: dict[str, torch.Tensor], quant_method: str | None,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A block's tensors as stored -> every one in `dtype`. ValueError for a format not read here."""
    if quant_method == "mxfp4":
        state = _mxfp4_pairs_dequantized(state, dtype)
    elif quant_method is not None:
        raise ValueError(f"weights published as {quant_method!r} are not read by bloompeer (it reads mxfp4)")
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
