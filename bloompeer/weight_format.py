"""How a server stores and computes its blocks' weights: one value, from the flags to the records.

The kernels (blocks/quantized_linear.py), the DHT records (p2p/records.py), the flags, routing,
verification, `status`, the dashboard and `/v1/models` all read the same four facts: how the linear
weights are stored (none, int8, int4 with its group size), the dtype everything else computes in,
and the kind of device. So the value lives here, below every room (as errors.py does), and imports
neither torch nor anything of bloompeer: the command line reads it before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["DEFAULT_GROUP_SIZE", "DEVICE_KINDS", "DTYPES", "INT4_GROUP_SIZES", "QUANT_KINDS", "WeightFormat"]

QUANT_KINDS = ("none", "int8", "int4")  # none: the linear weights in the model's dtype
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's 4-bit kernels take, on the CPU and on CUDA
# benchmarks/quantization.py: the group sizes ran within noise of each other (1 row 118-129 us, 8 rows
# 409-420 us); demo-model perplexity +0.43 % (32), +0.55 % (64), +0.65 % (128), +0.84 % (256) over
# float32; bytes 0.156x, 0.141x, 0.133x, 0.129x float32's. 64 is in the middle, and divides more
# layer widths than 128 or 256 do (the tests' hidden 64, Qwen2-0.5B's 896).
DEFAULT_GROUP_SIZE = 64
DTYPES = ("float32", "bfloat16", "float16")  # what a server computes and caches in (p2p/tensors.py's float dtypes)
DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class WeightFormat:
    """How one server's blocks are stored and computed. Norms, biases and the cache are always in
    `dtype`; only the linear weights are quantized.

    Built through `of` from what a user gives (a device like cuda:1, a group size for any kind);
    the constructor takes only normalized values, and raises ValueError for anything else.
    """

    quant: str = "none"  # QUANT_KINDS
    group_size: int = 0  # inputs per 4-bit group (INT4_GROUP_SIZES); 0 for the other kinds
    dtype: str = "float32"  # DTYPES
    device: str = "cpu"  # the kind of device it computes on (DEVICE_KINDS)

    def __post_init__(self):
        if self.quant not in QUANT_KINDS:
            raise ValueError(f"unknown weight format {self.quant!r}: one of {', '.join(QUANT_KINDS)}")
        if self.quant == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"4-bit group size {self.group_size!r} is not one the kernels take: {INT4_GROUP_SIZES}")
        if self.quant != "int4" and self.group_size != 0:
            raise ValueError(f"a group size ({self.group_size!r}) belongs to int4 weights only, not {self.quant}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one a server computes in: {', '.join(DTYPES)}")
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"device kind {self.device!r} is not one of {', '.join(DEVICE_KINDS)}")

    @classmethod
    def of(cls, quant: str = "none", group_size: int = DEFAULT_GROUP_SIZE, dtype: str = "float32",
           device: str = "cpu") -> WeightFormat:
        """From a server's settings: the group size counts for int4 only, and cuda:N is of kind cuda."""
        return cls(quant, group_size if quant == "int4" else 0, dtype, device.partition(":")[0])

    @property
    def quantized(self) -> bool:
        return self.quant != "none"

    @property
    def arithmetic(self) -> WeightFormat:
        """What decides the values a server computes: two servers compute alike only if their
        arithmetics are equal. The device counts for int8 only, which CUDA computes otherwise than
        the CPU (blocks/quantized_linear.py); for the other kinds it reads as the CPU."""
        return self if self.quant == "int8" else dataclasses.replace(self, device="cpu")

    @property
    def label(self) -> str:
        """In a word, as `status`, the dashboard and /v1/models show it: the dtype of float weights
        (float32, bfloat16 ...), int8, or int4/64 (4-bit, groups of 64)."""
        if self.quant == "int4":
            return f"int4/{self.group_size}"
        return self.dtype if self.quant == "none" else self.quant

    def __str__(self) -> str:
        return f"int4 (groups of {self.group_size})" if self.quant == "int4" else self.label
