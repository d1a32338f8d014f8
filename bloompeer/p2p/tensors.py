"""Tensors on the wire: {"dtype", "shape", "codec", "data"} maps inside msgpack frames.

`dtype` and `shape` are what the receiver gets; `codec` (see codecs.py) is how the values were
packed. Decoding checks the dtype and codec against allow-lists, the shape against the field's
number of dims and sane bounds, and the byte length against the shape before a tensor is built;
the tensor then owns a private copy of the bytes. Whatever torch still raises on a peer's tensor is
a ProtocolError too.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..weight_format import DTYPES
from . import codecs
from .errors import ErrorCode, ProtocolError

__all__ = [
    "WIRE_DTYPES", "FLOAT_DTYPES", "MAX_TENSOR_EXTENT", "dtype_name", "tensor_to_wire", "optional_tensor_to_wire",
    "tensor_from_wire",
]

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "bool": torch.bool,
}
FLOAT_DTYPES = frozenset(DTYPES)  # the dtypes servers compute in: activations travel in them
# the product of a shape's nonzero dims: an empty tensor needs no bytes, so only this bounds its dims
# (torch fails on sizes past int64, or whose product overflows); far beyond any real tensor
MAX_TENSOR_EXTENT = 1 << 48
# what torch raises on sizes and buffers it cannot use: a peer's bad data, answered as bad_request
_TORCH_ERRORS = (RuntimeError, TypeError, ValueError, OverflowError, IndexError)
_TENSOR_KEYS = frozenset({"dtype", "shape", "codec", "data"})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_to_wire(tensor: torch.Tensor, codec: str = "raw") -> dict[str, Any]:
    tensor = tensor.detach().cpu().contiguous()
    if codec != "raw" and not tensor.is_floating_point():
        codec = "raw"  # masks and indices are never compressed
    return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "codec": codec,
            "data": codecs.encode(tensor, codec)}


def optional_tensor_to_wire(tensor: torch.Tensor | None, codec: str = "raw") -> dict[str, Any] | None:
    """An optional field's value: absent (None) stays absent."""
    return None if tensor is None else tensor_to_wire(tensor, codec)


def tensor_from_wire(obj: Any, name: str, allowed_dtypes: frozenset[str], ndim: int) -> torch.Tensor:
    """Build a tensor of `ndim` dims from its wire map, refusing anything malformed. `name` is for messages.

    Everything is checked before the bytes are decoded: a lossy codec's decoding makes several times
    their size, so it must not be spent on a tensor the field never takes.
    """
    if not isinstance(obj, dict) or set(obj) != _TENSOR_KEYS:
        raise ProtocolError(f"{name}: a tensor is a map with exactly the keys {sorted(_TENSOR_KEYS)}")
    dtype_str, shape, codec, data = obj["dtype"], obj["shape"], obj["codec"], obj["data"]
    if not isinstance(dtype_str, str) or dtype_str not in allowed_dtypes:
        raise ProtocolError(f"{name}: dtype {dtype_str!r} is not one of {sorted(allowed_dtypes)}")
    if not isinstance(codec, str) or codec not in codecs.CODECS or (codec != "raw" and dtype_str not in FLOAT_DTYPES):
        raise ProtocolError(f"{name}: codec {str(codec)[:40]!r} is not supported for {dtype_str}",
                            ErrorCode.UNSUPPORTED)
    _check_shape(shape, ndim, name)
    if not isinstance(data, bytes):
        raise ProtocolError(f"{name}: data must be bytes")
    dtype, numel = WIRE_DTYPES[dtype_str], math.prod(shape)
    expected_bytes = codecs.encoded_nbytes(codec, numel, dtype)
    if len(data) != expected_bytes:
        raise ProtocolError(f"{name}: {len(data)} bytes of data for shape {shape} of {dtype_str} in {codec} "
                            f"({expected_bytes})")
    if dtype is torch.bool and data.translate(None, b"\x00\x01"):
        raise ProtocolError(f"{name}: a bool is the byte 0 or 1")  # torch assumes so and does not check
    return _build(data, codec, dtype, shape, name)


def _check_shape(shape: Any, ndim: int, name: str) -> None:
    """Refuse a shape the field does not take, torch could not make, or that would need absurd memory."""
    if not isinstance(shape, list) or len(shape) != ndim or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise ProtocolError(f"{name}: shape must be {ndim} dims, each a non-negative int; got {str(shape)[:60]}")
    if math.prod(dim for dim in shape if dim) > MAX_TENSOR_EXTENT:
        raise ProtocolError(f"{name}: the nonzero dims of shape {str(shape)[:100]} make over {MAX_TENSOR_EXTENT}")


def _build(data: bytes, codec: str, dtype: torch.dtype, shape: list[int], name: str) -> torch.Tensor:
    """The tensor of checked wire fields; a torch error on them is the peer's bad data."""
    numel = math.prod(shape)
    try:
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return codecs.decode(data, codec, dtype, numel).reshape(shape)
    except _TORCH_ERRORS as exc:
        first_line = str(exc).split("\n", 1)[0][:200]  # torch appends its C++ stack
        raise ProtocolError(f"{name}: cannot build this tensor: {type(exc).__name__}: {first_line}") from exc
