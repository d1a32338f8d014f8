"""A model's blocks as a server would store them (`serve --quant`), reckoned from the config alone:
what the memory plan counts and what is checked before anything loads.

Blocks of one model may differ (dense and sparse layers of one mixture of experts), so every figure is
per block, from the block's own shapes: the whole model is built on the meta device, which holds
shapes and no memory. The loader itself quantizes each block as it is read (blocks/quantized_linear.py
`quantize_block`, run by Checkpoint.load_span), so the float weights of a span never sit in memory at
once. On a CUDA device that runs after the block was moved there, so int8 weights sit on the GPU for
CUDA's GEMM and 4-bit ones are packed for torch._weight_int4pack_mm (tests/unit/test_quantized_linear.py
runs there with BLOOMPEER_TEST_DEVICE=cuda, scripts/device_check.sh).
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import nn

from ...blocks import (
    Checkpoint, check_int4_shape, check_kernels, float32_parameter_names, int8_cuda_arithmetic_on, stored_weight_nbytes,
)
from ...weight_format import WeightFormat

__all__ = ["StoredBlocks"]


class StoredBlocks:
    """Every block of `checkpoint` stored as `weights` says (its quant and dtype; its device kind)."""

    def __init__(self, checkpoint: Checkpoint, weights: WeightFormat):
        self.checkpoint, self.weights = checkpoint, weights

    @cached_property
    def _blocks(self) -> nn.ModuleList:
        """The model's blocks, shapes only."""
        config = self.checkpoint.config()
        with torch.device("meta"):
            return self.checkpoint.family.span_class(config, 0, config.num_hidden_layers).blocks

    @cached_property
    def block_nbytes(self) -> tuple[int, ...]:
        """Bytes of each block's parameters and buffers as stored: linear weights in this format, the rest
        (norms, biases) in the dtype, but those kept in float32 (DeepSeek-V3's routers)."""
        return tuple(self._stored_nbytes(block) for block in self._blocks)

    def _stored_nbytes(self, block: nn.Module) -> int:
        element = getattr(torch, self.weights.dtype).itemsize
        linears = _linears(block)
        weights = {id(layer.weight) for layer in linears}
        state = block.state_dict(keep_vars=True)
        float32 = {id(state[name]) for name in float32_parameter_names(block)}
        rest = sum(t.numel() * (4 if id(t) in float32 else element)
                   for t in [*block.parameters(), *block.buffers()] if id(t) not in weights)
        return rest + sum(stored_weight_nbytes(layer.in_features, layer.out_features, self.weights.quant,
                                               self.weights.group_size, element) for layer in linears)

    def span_nbytes(self, start: int, end: int) -> int:
        return sum(self.block_nbytes[start:end])

    def largest_span_nbytes(self, length: int) -> int:
        """The most that `length` consecutive blocks take, wherever they are: what a server that chooses
        its blocks later (--num-blocks) must have room for."""
        sizes = self.block_nbytes
        return max(sum(sizes[start:start + length]) for start in range(len(sizes) - length + 1))

    def working_copy_nbytes(self) -> int:
        """Bytes of weights copied to compute with, beside the stored ones: int8 on CUDA computes each
        layer from its weight in the dtype, made for that layer and freed after it (one at a time, so
        the largest layer's); nothing otherwise."""
        if self.weights.quant != "int8" or not int8_cuda_arithmetic_on(self.weights.device):
            return 0
        element = getattr(torch, self.weights.dtype).itemsize
        return max(layer.in_features * layer.out_features for block in self._blocks for layer in _linears(block)) \
            * element

    def check(self, device: str) -> None:
        """Raise ValueError, naming the flag, if some block's layers cannot be stored this way, or PyTorch's
        kernels for it do not compute right on `device`."""
        quant, group_size = self.weights.quant, self.weights.group_size
        if quant == "int4":  # int8 takes any width
            shapes = {(layer.in_features, layer.out_features) for block in self._blocks for layer in _linears(block)}
            for in_features, out_features in sorted(shapes):
                try:
                    check_int4_shape(in_features, out_features, group_size)
                except ValueError as exc:
                    raise ValueError(f"--quant int4: {exc} (--quant-group-size, or --quant int8)") from None
        if not self.weights.quantized:
            return
        try:
            check_kernels(quant, device, group_size)
        except RuntimeError as exc:
            instead = "--quant int8, or --quant none" if quant == "int4" else "--quant none, or --device cpu"
            raise ValueError(f"--quant {quant} does not compute on {_device_name(device)}: {exc} ({instead})") from None


def _linears(block: nn.Module) -> list[nn.Linear]:
    return [module for module in block.modules() if isinstance(module, nn.Linear)]


def _device_name(device: str) -> str:
    """`device` with what it is, where that says more (a GPU's name and compute capability)."""
    if torch.device(device).type != "cuda":
        return device
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, compute capability {major}.{minor})"
