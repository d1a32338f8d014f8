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

import numpy as np
import torch

__all__ = ["CODECS", "LOSSY_CODECS", "encode", "decode", "encoded_nbytes"]

BLOCK = 256
_CHUNK_BLOCKS = 4096  # blocks decoded at a time into a non-float32 output: a float32 scratch of 4 MiB
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
    return _decode_blockwise(data, dtype, numel)


def _decode_blockwise(data: bytes, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """int8-blockwise into one buffer, the output: it is 4 bytes of float32 per byte received, so
    each full-size intermediate would cost 4 times the frame. Scales and values are read in place
    from `data` (numpy views, read only), and numpy scales each chunk of blocks straight into the
    output (through a small float32 scratch when the output is not float32)."""
    blocks = math.ceil(numel / BLOCK)
    scales = np.frombuffer(data, np.float32, count=blocks)
    values = np.frombuffer(data, np.int8, count=numel, offset=4 * blocks)
    out = torch.empty(numel, dtype=dtype)
    scratch = None if dtype == torch.float32 else torch.empty(min(numel, _CHUNK_BLOCKS * BLOCK))
    for first in range(0, blocks, _CHUNK_BLOCKS):
        start, stop = first * BLOCK, min((first + _CHUNK_BLOCKS) * BLOCK, numel)
        target = out[start:stop] if scratch is None else scratch[: stop - start]
        _scale_blocks(values[start:stop], scales[first: first + _CHUNK_BLOCKS], target.numpy())
        if scratch is not None:
            out[start:stop].copy_(target)
    return out


def _scale_blocks(values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """out = each value times its block's scale, in float32; the last block may be partial."""
    whole = len(values) // BLOCK * BLOCK
    np.multiply(values[:whole].reshape(-1, BLOCK), scales[: whole // BLOCK, None], out=out[:whole].reshape(-1, BLOCK),
                dtype=np.float32)
    if whole < len(values):
        np.multiply(values[whole:], scales[-1], out=out[whole:], dtype=np.float32)
