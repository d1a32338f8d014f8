"""How a server stores its blocks' linear weights (`serve --quant`), turned into what loading and the
memory plan need: the hook that quantizes each block as the checkpoint is read (so the float
weights of the whole span never sit in memory at once), and the bytes one block takes stored so.

The layers and kernels are blocks/quantized_linear.py's. On a CUDA device the hook runs after the
block was moved there (Checkpoint.load_span), so int8 weights go to torch._weight_int8pack_mm's
CUDA kernel and 4-bit ones are packed for torch._weight_int4pack_mm; that path is written from
the kernels' sources and was not run (no GPU at hand).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...blocks import Checkpoint
from ...blocks.quantized_linear import check_int4_shape, quantize_linears, stored_weight_nbytes

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
        return lambda block: quantize_linears(block, self.kind, self.group_size)

    def check(self, checkpoint: Checkpoint) -> None:
        """Raise ValueError, naming the flag, if the model's layers cannot be stored this way."""
        if self.kind != "int4":
            return
        for layer in _linears(checkpoint):
            try:
                check_int4_shape(layer.in_features, layer.out_features, self.group_size)
            except ValueError as exc:
                raise ValueError(f"--quant int4: {exc} (--quant-group-size, or --quant int8)") from None

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


def _meta_block(checkpoint: Checkpoint) -> nn.Module:
    """Block 0 of the model, shapes only (every block of a served model has the same)."""
    with torch.device("meta"):
        return checkpoint.family.span_class(checkpoint.config(), 0, 1).blocks[0]


def _linears(checkpoint: Checkpoint) -> list[nn.Linear]:
    return [module for module in _meta_block(checkpoint).modules() if isinstance(module, nn.Linear)]
