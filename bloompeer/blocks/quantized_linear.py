"""Linear layers whose weights are stored in int8 or 4 bits, computed by PyTorch's own kernels.

Why: a decode step reads every weight of the span once, so it is bound by memory bandwidth, and
weights a quarter or an eighth the size are read faster as well as fitting more blocks on a
volunteer's machine. For a 1024x4096 layer on one thread (median CPU time; 2-core machine shared
with other work; `python benchmarks/quantization.py`): one row 343 us with float32 F.linear and
118-129 us with 4-bit weights; eight rows 1487 and 409-420 us. A long prefill gains less (512
rows: 43.4 ms float32 with MKL, 19.2 through oneDNN, 26-28 with 4-bit weights).

What is computed, int8, on the CPU: PyTorch's weight-only int8 kernel (torch._weight_int8pack_mm):
the input rounded to bfloat16, summed against the int8 weight in float32, times each output
channel's scale, rounded to bfloat16: bf16(F.linear(bf16(x), q) * scale), then back to the
activations' dtype and plus the bias. A row's result does not depend on the other rows of a pass.
Why this kernel and not the rows rounded to int8 through torch._int_mm (exact integer products):
_int_mm is fast only on CPUs with VNNI. On this project's AMD EPYC VMs (AVX2, no VNNI), one row of
a 1024x4096 layer on one thread took 3.55 ms through _int_mm and 0.48 ms through this kernel,
against 1.34 ms for float32 (8 rows: 47 ms, 1.8 and 8.0; 512 rows: 2.5 s, 146 and 131 ms); on an
AVX-512 machine of an earlier run, 186 us through _int_mm and 297 through this kernel, against 615.

What is computed, int8, on CUDA: F.linear(x, q) in the activations' dtype, then each output
channel times its scale: W_deq without its rounding of the input, two elementwise passes and one
GEMM. Measured on an H200 (one row of the 1024x4096 layer, bfloat16, wall time of the launches,
2026-12-04): 85 us, against 365 for the CPU's arithmetic through CUDA's _int_mm (its 14 small
kernels take 25 us of the GPU; launching them takes the rest), 67 for _weight_int8pack_mm (a
plain loop, one thread per output: 310 us for a 4096x14336 layer, 66 ms for 512 rows of it) and
44 for bfloat16 F.linear. Its result is closer to float32's than the CPU's (relative error
4.5e-3 against 9e-3 per layer), but it is not the CPU's: the same span in bfloat16 differed by
2.0-3.0 % on the H200 and on the CPU, at verification's 3 % tolerance, so verification compares
int8 servers only with servers on the same kind of device (WeightFormat.arithmetic), and a
client checking a CUDA server on its CPU computes CUDA's way (Int8Linear's cuda_arithmetic).

What is computed, 4-bit: the matmul's input is rounded to bfloat16 (the weight-only kernels' fast
path: with float32 activations the 4-bit one took 6.4 ms a row), the kernel accumulates in float32
and rounds its output to bfloat16, and the output goes back to the activations' dtype before the
bias (kept in the model's dtype) is added: up to the kernel's summation order, F.linear(bf16(x),
W_deq) rounded to bfloat16, plus the bias, where W_deq is the dequantized weight that
`dequantized_weight` returns. (CUDA's kernel dequantizes in bfloat16, so there W_deq is rounded to
bfloat16 too.)

Formats: int8 is symmetric per output channel (q in [-127, 127], W_deq = q * scale); 4-bit is
affine per group of `group_size` inputs (q in [0, 15], W_deq = (q - 8) * scale + zero, the
kernels' own convention); scales and zeros are bfloat16, as the kernels take them. A 4-bit weight
is packed for the device it sits on (the CPU and CUDA packings differ): quantize a module after
moving it, never move it afterwards.

Backward (fine-tuning through a quantized server: the weights stay frozen) gives the input's
gradient, grad @ W_deq, with W_deq dequantized for that one layer and dropped after: for 8 rows of
the 1024x4096 layer 4.5 ms (int8) and 6.5-7.4 ms (4-bit) against 3.2 ms for float32's backward.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
import torch.nn.functional as F
from torch import nn

from ..weight_format import DEFAULT_GROUP_SIZE, INT4_GROUP_SIZES, QUANT_KINDS, WeightFormat

__all__ = [
    "Int4Linear", "Int8Linear", "QuantizedLinear", "check_int4_shape", "check_kernels", "int8_cuda_arithmetic_on",
    "quantize_block", "quantize_linears", "stored_weight_nbytes",
]

_KERNEL_DTYPE = torch.bfloat16
_INT4_ROWS_MULTIPLE = 16  # the CPU packing needs out_features divisible by 16 (CUDA's needs 8)
_SELF_CHECK_SHAPE = (256, 64)  # (in, out): every group size divides 256; 64 rows fill every packing's row block
# |y - y_float| / |y_float| that a layer of random normal weights may show, at most: measured 0.009-0.011 for
# int8 and 0.07-0.12 for 4-bit (groups of 32 to 256); a kernel computing something else shows 1 or more
_SELF_CHECK_BOUNDS = {"int8": 0.05, "int4": 0.3}


class QuantizedLinear(nn.Module):
    """A frozen linear layer y = x W^T + b with W stored quantized; subclasses say how."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., in_features] -> [..., out_features], in rows' dtype."""
        flat = rows.reshape(-1, self.in_features)
        if rows.requires_grad and torch.is_grad_enabled():
            output = _QuantizedMatmul.apply(flat, self)
        else:
            output = self.matmul(flat)
        if self.bias is not None:
            output = output + self.bias
        return output.view(*rows.shape[:-1], self.out_features)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in_features] @ W_deq^T through the kernel, in rows' dtype (no bias)."""
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W_deq [out_features, in_features]: the weight the kernel computes with."""
        raise NotImplementedError

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the stored weight, scales and zeros included (the bias not)."""
        return sum(buffer.nbytes for buffer in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantizedLinear):
    """int8 weights, one scale per output channel (symmetric), computed by the CPU's weight-only kernel
    on bfloat16 rows, or CUDA's way on CUDA (module docstring). cuda_arithmetic: compute CUDA's way
    wherever the layer is (a client checking a CUDA server's output on its CPU); None: the way of the
    device the weight is on, so quantize after moving, as for 4-bit."""

    def __init__(self, linear: nn.Linear, cuda_arithmetic: bool | None = None):
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        on_cuda = int8_cuda_arithmetic_on(linear.weight.device)
        self.cuda_arithmetic = on_cuda if cuda_arithmetic is None else cuda_arithmetic
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(_KERNEL_DTYPE)
        quantized = torch.round(weight / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("weight_int8", quantized.contiguous())  # [out, in]
        self.register_buffer("scales", scales)  # [out]

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self.cuda_matmul(rows) if self.cuda_arithmetic else self.cpu_matmul(rows)

    def cpu_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """The CPU's arithmetic: bf16(F.linear(bf16(rows), q) * scale), in the rows' dtype."""
        packed = torch._weight_int8pack_mm(rows.to(_KERNEL_DTYPE).contiguous(), self.weight_int8, self.scales)
        return packed.to(rows.dtype)

    def cuda_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """CUDA's arithmetic: the integer weights in the rows' dtype (exact: |q| <= 127), one GEMM, then
        the output channels' scales; few launches, which bound a small layer's time on a GPU."""
        return F.linear(rows, self.weight_int8.to(rows.dtype)).mul_(self.scales)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight_int8.float() * self.scales.float()[:, None]).to(dtype)


def int8_cuda_arithmetic_on(device: torch.device | str) -> bool:
    """Whether int8 computes CUDA's way (module docstring) on this kind of device."""
    return torch.device(device).type == "cuda"


class Int4Linear(QuantizedLinear):
    """4-bit weights in groups of `group_size` inputs, each with a scale and a zero (affine);
    torch._weight_int4pack_mm_for_cpu on the CPU, torch._weight_int4pack_mm on CUDA."""

    def __init__(self, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE):
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        check_int4_shape(linear.in_features, linear.out_features, group_size)
        self.group_size = group_size
        weight = linear.weight.detach()
        quantized, scales_and_zeros = _quantize_groups(weight.float().contiguous(), group_size)
        self.device_type = weight.device.type  # what the packing below is for
        self.register_buffer("weight_int4", _pack_int4(quantized, weight.device))
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / group, out, 2]: scale, zero
        # Whether the CPU packing reads back as we expect; else backward dequantizes through the kernel
        self._unpackable = self.device_type == "cpu" and torch.equal(self._unpack_cpu(), quantized.to(torch.uint8))

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self._kernel(rows.to(_KERNEL_DTYPE).contiguous()).to(rows.dtype)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """The weight-only kernel on bfloat16 rows [n, in_features] -> bfloat16 [n, out_features]."""
        if self.weight_int4.device.type != self.device_type:
            raise RuntimeError(f"4-bit weights were packed for {self.device_type} and cannot run on "
                               f"{self.weight_int4.device.type}: quantize the layer on the device it runs on")
        if self.device_type == "cpu":
            return torch._weight_int4pack_mm_for_cpu(rows, self.weight_int4, self.group_size, self.scales_and_zeros)
        return torch._weight_int4pack_mm(rows, self.weight_int4, self.group_size, self.scales_and_zeros)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not self._unpackable:
            return self._dequantized_through_kernel().to(dtype)
        groups = self._unpack_cpu().float().view(self.out_features, -1, self.group_size)
        scales, zeros = (part.t().contiguous()[..., None] for part in self.scales_and_zeros.float().unbind(-1))
        # in place and on contiguous operands: 5.6 ms for 1024x4096 where a broadcast of the permuted
        # [groups, out, 2] tensor took 22.6
        return groups.sub_(8).mul_(scales).add_(zeros).view(self.out_features, self.in_features).to(dtype)

    def _unpack_cpu(self) -> torch.Tensor:
        """The CPU packing read back to q [out, in] (uint8), for the layout that
        aten/src/ATen/native/cpu/int4mm_kernel.cpp documents per CPU capability: per block of
        `block` output rows and per input, `block / 2` bytes; byte j holds rows j and j + block/2
        (AVX512, block 64; AVX2, block 32) or rows 2j and 2j + 1 (no vector unit, block 32), the
        first in the low nibble. A partial last block is packed otherwise: the caller checks."""
        vectorized = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")
        block = 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32
        if self.out_features % block:
            return torch.empty(0, dtype=torch.uint8)
        packed = self.weight_int4.view(self.out_features // block, self.in_features, block // 2)
        low, high = packed & 15, packed >> 4
        if vectorized:
            rows = torch.cat([low, high], dim=-1)
        else:
            rows = torch.stack([low, high], dim=-1).flatten(-2)
        return rows.transpose(1, 2).reshape(self.out_features, self.in_features)

    @torch.no_grad()
    def _dequantized_through_kernel(self, chunk_rows: int = 256) -> torch.Tensor:
        """W_deq from the kernel applied to the identity, chunk by chunk (bfloat16-rounded): for the
        packings we do not read back (CUDA's tensor-core layout), at the price of in_features rows."""
        columns = []
        for start in range(0, self.in_features, chunk_rows):
            rows = torch.arange(min(chunk_rows, self.in_features - start), device=self.weight_int4.device)
            identity = torch.zeros(len(rows), self.in_features, dtype=_KERNEL_DTYPE, device=rows.device)
            identity[rows, start + rows] = 1
            columns.append(self._kernel(identity))  # [chunk, out]: columns start.. of W_deq
        return torch.cat(columns).t()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


@torch.no_grad()
def check_kernels(kind: str, device: torch.device | str, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """Raise RuntimeError unless `kind`'s kernels compute on `device` a small random layer as close to its
    float result as the format allows: a kernel the device cannot run (CUDA's 4-bit one needs compute
    capability 8.0) or one that computes something else is found when a server starts, not at a
    client's first step."""
    if kind == "none":
        return
    in_features, out_features = _SELF_CHECK_SHAPE
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(torch.randn(out_features, in_features, generator=generator).to(device),
                                 requires_grad=False)
    rows = torch.randn(3, in_features, generator=generator).to(device)
    layer = Int8Linear(linear) if kind == "int8" else Int4Linear(linear, group_size)
    expected = linear(rows)
    error = float((layer(rows) - expected).norm() / expected.norm())
    if not error <= _SELF_CHECK_BOUNDS[kind]:
        raise RuntimeError(f"its kernels computed a test layer {error:.0%} off the float result, where {kind} "
                           f"stays within {_SELF_CHECK_BOUNDS[kind]:.0%}")


def check_int4_shape(in_features: int, out_features: int, group_size: int) -> None:
    """Raise ValueError where the 4-bit kernels cannot take a layer of this shape."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"4-bit group size {group_size} is not one the kernels take: {INT4_GROUP_SIZES}")
    if in_features % group_size:
        raise ValueError(f"a layer of {in_features} inputs cannot be cut into 4-bit groups of {group_size}: "
                         f"choose a group size that divides it, among {INT4_GROUP_SIZES}")
    if out_features % _INT4_ROWS_MULTIPLE:
        raise ValueError(f"a layer of {out_features} outputs cannot be packed in 4 bits "
                         f"(the kernels need a multiple of {_INT4_ROWS_MULTIPLE})")


def stored_weight_nbytes(in_features: int, out_features: int, kind: str, group_size: int = DEFAULT_GROUP_SIZE,
                         float_bytes: int = 4) -> int:
    """Bytes a linear layer's weight takes stored as `kind` (scales and zeros included, the bias not),
    without building it: what a memory plan counts before anything is loaded. float_bytes: the
    model dtype's element size, for "none"."""
    if kind == "int8":
        return out_features * in_features + 2 * out_features  # int8 q, bfloat16 scale per row
    if kind == "int4":  # two values a byte; a bfloat16 scale and zero per group and row
        return out_features * in_features // 2 + 4 * out_features * (in_features // group_size)
    return float_bytes * out_features * in_features


def _quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float32 -> q [out, in] int32 in [0, 15], scales_and_zeros [in / group, out, 2]
    (bfloat16), such that (q - 8) * scale + zero is the nearest grid point to each weight; each
    group's grid spans its minimum to its maximum."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(_KERNEL_DTYPE)
    zeros = (low + 8 * scales.float()).to(_KERNEL_DTYPE)
    steps = (groups - zeros.float()[..., None]) / scales.float()[..., None]
    quantized = torch.round(steps).add_(8).clamp_(0, 15).to(torch.int32).view(out_features, in_features)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return quantized, scales_and_zeros


def _pack_int4(quantized: torch.Tensor, device: torch.device) -> torch.Tensor:
    """q [out, in] int32 -> the kernel's packed layout on `device`."""
    if device.type == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(quantized, 2)  # inner_k_tiles: unused on the CPU
    # CUDA takes two values a byte, the even input in the high nibble, then tiles them for its
    # tensor cores, with as many k-tiles of 16 inputs innermost (2, 4 or 8) as the width allows.
    # Written from the kernel's source (aten/src/ATen/native/cuda/int4mm.cu, torch 2.13); run on an
    # H200 with torch 2.11 (scripts/device_check.sh, 2026-12-04).
    nibbles = ((quantized[:, ::2] << 4) | quantized[:, 1::2]).to(torch.uint8).to(device)
    inner_k_tiles = next(tiles for tiles in (8, 4, 2) if quantized.shape[1] % (tiles * 16) == 0)
    return torch._convert_weight_to_int4pack(nibbles.contiguous(), inner_k_tiles)


class _QuantizedMatmul(torch.autograd.Function):
    """rows @ W_deq^T through the kernel; backward gives the input's gradient only (W is frozen)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        return layer.matmul(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad @ ctx.layer.dequantized_weight(grad.dtype), None


def quantize_linears(block: nn.Module, kind: str, group_size: int = DEFAULT_GROUP_SIZE,
                     int8_cuda_arithmetic: bool | None = None) -> int:
    """Replace, in place, every nn.Linear inside `block` by its `kind` form ("none" leaves them);
    returns the bytes saved. Meant for one block at a time, so that a loader never holds the float
    weights of a whole span: each layer's float weight is freed as it is replaced (where nothing
    else refers to it). int8_cuda_arithmetic: as Int8Linear's cuda_arithmetic."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"unknown weight format {kind!r}: one of {', '.join(QUANT_KINDS)}")
    if kind == "none":
        return 0
    saved = 0
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            quantized = Int8Linear(child, int8_cuda_arithmetic) if kind == "int8" else Int4Linear(child, group_size)
            saved += child.weight.nbytes - quantized.weight_nbytes
            setattr(parent, name, quantized)
    return saved



def quantize_block(block: nn.Module, weights: WeightFormat) -> None:
    """Store a freshly loaded block's linear weights as `weights` says, in place, and give its memory
    back: what a server's loader, and a client recomputing a server's blocks to check them, run on
    each block (Checkpoint.load_span's prepare_block). int8 computes as `weights.device` does, also
    where the block is not (a client's CPU checking a CUDA server)."""
    if not weights.quantized:
        return
    quantize_linears(block, weights.quant, weights.group_size, int8_cuda_arithmetic_on(weights.device))
    _own_memory(block)
    _release_freed_memory()


def _own_memory(block: nn.Module) -> None:
    """Give the block's remaining tensors (norms, biases) memory of their own. Read from safetensors,
    they are views of the shard's file mapping, which stays mapped, with every page of the float
    weights that quantizing read, as long as one view lives: 4 blocks of hidden 1024 kept 250 MiB
    of RSS for 48 MiB of int8 weights."""
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.data = tensor.data.clone()


def _release_freed_memory() -> None:
    """Hand the allocator's free pages back to the OS (glibc's malloc_trim; nothing elsewhere): the
    quantizer's float temporaries, freed, would otherwise stay in the heap's RSS (another 175 MiB for
    the 4 blocks above)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
