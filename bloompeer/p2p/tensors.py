"""Tensors on the wire: {"dtype", "shape", "codec", "data"} maps inside msgpack frames.

Decoding checks the dtype against an allow-list and the byte length against the shape before
a tensor is built; the tensor then owns a private copy of the bytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .errors import ErrorCode, ProtocolError

__all__ = ["WIRE_DTYPES", "FLOAT_DTYPES", "MAX_TENSOR_DIMS", "dtype_name", "tensor_to_wire", "tensor_from_wire"]

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "bool": torch.bool,
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
MAX_TENSOR_DIMS = 4
_TENSOR_KEYS = frozenset({"dtype", "shape", "codec", "data"})
# numpy (which does the byte view) has no bfloat16; it travels as the int16 with the same bits.
_STORAGE_DTYPES = {torch.bfloat16: torch.int16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_to_wire(tensor: torch.Tensor) -> dict[str, Any]:
    tensor = tensor.detach().cpu().contiguous()
    storage = tensor.view(_STORAGE_DTYPES.get(tensor.dtype, tensor.dtype))
    return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "codec": "raw",
            "data": storage.numpy().tobytes()}


def tensor_from_wire(obj: Any, name: str, allowed_dtypes: frozenset[str]) -> torch.Tensor:
    """Build a tensor from its wire map, refusing anything malformed. `name` is for messages."""
    if not isinstance(obj, dict) or set(obj) != _TENSOR_KEYS:
        raise ProtocolError(f"{name}: a tensor is a map with exactly the keys {sorted(_TENSOR_KEYS)}")
    dtype_str, shape, codec, data = obj["dtype"], obj["shape"], obj["codec"], obj["data"]
    if not isinstance(dtype_str, str) or dtype_str not in allowed_dtypes:
        raise ProtocolError(f"{name}: dtype {dtype_str!r} is not one of {sorted(allowed_dtypes)}")
    if codec != "raw":
        raise ProtocolError(f"{name}: codec {codec!r} is not supported", ErrorCode.UNSUPPORTED)
    if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
            or not all(type(dim) is int and dim >= 0 for dim in shape)):
        raise ProtocolError(f"{name}: shape must be a list of at most {MAX_TENSOR_DIMS} non-negative ints")
    if not isinstance(data, bytes):
        raise ProtocolError(f"{name}: data must be bytes")
    dtype = WIRE_DTYPES[dtype_str]
    storage_dtype = _STORAGE_DTYPES.get(dtype, dtype)
    expected_bytes = math.prod(shape) * torch.empty((), dtype=storage_dtype).element_size()
    if len(data) != expected_bytes:
        raise ProtocolError(f"{name}: {len(data)} bytes of data for shape {shape} of {dtype_str} ({expected_bytes})")
    if expected_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=storage_dtype)
    return flat.view(dtype).reshape(shape)
