"""How a server stores its blocks' linear weights (`serve --quant`), turned into what loading and the
memory plan need: the hook that quantizes each block as the checkpoint is read (so the float
weights of the whole span never sit in memory at once), and the bytes one block takes stored so.

The layers and kernels are blocks/quantized_linear.py's. On a CUDA device the hook runs after the
block was moved there (Checkpoint.load_span), so int8 weights sit on the GPU for CUDA's GEMM and
4-bit ones are packed for torch._weight_int4pack_mm; tests/unit/test_quantized_linear.py runs
there with BLOOMPEER_TEST_DEVICE=cuda (scripts/device_check.sh).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...blocks import Checkpoint
from ...blocks.quantized_linear import (
    check_int4_shape, check_kernels, int8_weight_only_on, quantize_linears, stored_weight_nbytes,
)

__all__ = ["WeightStorage"]


@dataclass(frozen=True)
class WeightStorage:
    """kind: none, int8 or int4; group_size: inputs per 4-bit group (announced as 0 for the others)."""

    kind: str
    group_size: int

    @property
    def announced_group_size(self) -> int:
        return self.group_size if self.kind == "int4" else 0

    def __str__(self) -> str:
        return f"int4 (groups of {self.group_size})" if self.kind == "int4" else self.kind

    def block_hook(self) -> Callable[[nn.Module], None] | None:
        """What Checkpoint.load_span runs on each block once loaded (None: float weights, nothing to do)."""
        if self.kind == "none":
            return None
        return self._quantize_block

    def _quantize_block(self, block: nn.Module) -> None:
        quantize_linears(block, self.kind, self.group_size)
        _own_memory(block)
        _release_freed_memory()

    def check(self, checkpoint: Checkpoint, device: str) -> None:
        """Raise ValueError, naming the flag, if the model's layers cannot be stored this way on `device`,
        or PyTorch's kernels for it do not compute right there."""
        if self.kind == "none":
            return
        if self.kind == "int4":  # int8 takes any width
            for layer in _linears(checkpoint):
                try:
                    check_int4_shape(layer.in_features, layer.out_features, self.group_size)
                except ValueError as exc:
                    raise ValueError(f"--quant int4: {exc} (--quant-group-size, or --quant int8)") from None
        try:
            check_kernels(self.kind, device, self.group_size)
        except RuntimeError as exc:
            instead = "--quant int8, or --quant none" if self.kind == "int4" else "--quant none, or --device cpu"
            raise ValueError(f"--quant {self.kind} does not compute on {_device_name(device)}: {exc} "
                             f"({instead})") from None

    def working_copy_nbytes(self, checkpoint: Checkpoint, dtype: torch.dtype, device: str) -> int:
        """Bytes of weights copied to compute with, beside the stored ones: int8 on CUDA computes each
        layer from its weight in `dtype`, made for that layer and freed after it (one at a time, so
        the largest layer's); nothing otherwise."""
        if self.kind != "int8" or not int8_weight_only_on(device):
            return 0
        return max(layer.in_features * layer.out_features for layer in _linears(checkpoint)) * dtype.itemsize

    def block_nbytes(self, checkpoint: Checkpoint, dtype: torch.dtype) -> int:
        """Bytes of one block's parameters and buffers as stored: linear weights in this format, the rest
        (norms, biases) in `dtype`. Computed from the config, nothing loaded."""
        element = torch.empty(0, dtype=dtype).element_size()
        block = _meta_block(checkpoint)
        linears = [module for module in block.modules() if isinstance(module, nn.Linear)]
        weights = {id(layer.weight) for layer in linears}
        rest = sum(t.numel() for t in [*block.parameters(), *block.buffers()] if id(t) not in weights) * element
        return rest + sum(stored_weight_nbytes(layer.in_features, layer.out_features, self.kind, self.group_size,
                                               element) for layer in linears)


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


def _meta_block(checkpoint: Checkpoint) -> nn.Module:
    """Block 0 of the model, shapes only (every block of a served model has the same)."""
    with torch.device("meta"):
        return checkpoint.family.span_class(checkpoint.config(), 0, 1).blocks[0]


def _device_name(device: str) -> str:
    """`device` with what it is, where that says more (a GPU's name and compute capability)."""
    if torch.device(device).type != "cuda":
        return device
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, compute capability {major}.{minor})"


def _linears(checkpoint: Checkpoint) -> list[nn.Linear]:
    return [module for module in _meta_block(checkpoint).modules() if isinstance(module, nn.Linear)]
