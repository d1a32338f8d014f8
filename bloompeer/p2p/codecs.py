"""How a tensor's values are packed into bytes on the wire, chosen per tensor by its sender.

    raw             the values as they are (exact)
    float16         2 bytes per value (floats; ~1e-3 relative error; the range of float16)
    bfloat16        2 bytes per value (floats; ~4e-3 relative error; the range of float32)
    int8-blockwise  1 byte per value plus a float32 scale per block of 256 values: each block is
                    scaled by its own largest magnitude, so activations with a few huge channels
                    (as transformers have) lose precision only in their own block (~1e-2 error)

hivemind ships 8-bit codecs too, but its blockwise one needs bitsandbytes and its uniform and
quantile decoders fail on numpy 2.4 (see hivemind-notes); this one is plain torch.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CODECS", "LOSSY_CODECS", "encode", "decode", "encoded_nbytes"]

BLOCK = 256
CODECS = frozenset({"raw", "float16", "bfloat16", "int8-blockwise"})
LOSSY_CODECS = CODECS - {"raw"}
_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    # numpy (which does the byte view) has no bfloat16; it travels as the int16 with the same bits
    storage = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return storage.numpy().tobytes()


def _from_raw(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    storage_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    return torch.frombuffer(bytearray(data), dtype=storage_dtype).view(dtype)


def encoded_nbytes(codec: str, numel: int, dtype: torch.dtype) -> int:
    """The exact byte length of `numel` values of `dtype` packed with `codec`."""
    if codec == "raw":
        return numel * dtype.itemsize
    if codec in _HALF:
        return 2 * numel
    return 4 * math.ceil(numel / BLOCK) + numel  # int8-blockwise: scales, then values


def encode(tensor: torch.Tensor, codec: str) -> bytes:
    """tensor: contiguous, on the CPU. Lossy codecs take floating tensors only."""
    if codec == "raw":
        return _raw_bytes(tensor)
    if codec in _HALF:
        return _raw_bytes(tensor.to(_HALF[codec]))
    flat = tensor.reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
    scales = padded.abs().amax(dim=1) / 127.0  # [blocks]
    values = torch.round(padded / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).to(torch.int8)
    return _raw_bytes(scales) + _raw_bytes(values.reshape(-1)[: flat.numel()])


def decode(data: bytes, codec: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The flat tensor of `dtype`; `data` must be encoded_nbytes(codec, numel, dtype) long."""
    if codec == "raw":
        return _from_raw(data, dtype)
    if codec in _HALF:
        return _from_raw(data, _HALF[codec]).to(dtype)
    blocks = math.ceil(numel / BLOCK)
    scales = _from_raw(data[: 4 * blocks], torch.float32)
    values = torch.frombuffer(bytearray(data[4 * blocks:]), dtype=torch.int8).float()
    padded = torch.nn.functional.pad(values, (0, -numel % BLOCK)).view(blocks, BLOCK)
    return (padded * scales[:, None]).reshape(-1)[:numel].to(dtype)
