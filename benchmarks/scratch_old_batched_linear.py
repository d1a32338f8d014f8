"""The linear layers of a pass that batches several sessions' rows, through numpy's OpenBLAS.

Why a second kernel: on the CPUs we serve from, MKL's float32 GEMM for 2 to 64 rows is far slower
per row than its GEMV for one, so a batched pass cost almost what its sessions cost one after
another. The 48 linear layers of 12 blocks of hidden 1024, on one thread: 1 row 62 ms (MKL); 8 rows
197 ms with MKL, 102 ms with OpenBLAS on weights stored input-major; 64 rows 667 against 386 ms.
The price is memory: each weight is kept a second time, transposed. The original stays, because
one request alone must still give transformers' values to the bit (with MKL, transformers' kernel).
A batched pass was never bitwise equal to its requests computed alone (MKL's 8-row GEMM is not
either); it stays within float32 rounding of them.

Above MAX_ROWS (long prompts batched together) MKL on every thread is as fast, and no copy is used.
"""

from __future__ import annotations

import numpy as np
import torch
from threadpoolctl import ThreadpoolController
from torch import nn

__all__ = ["BatchedLinears", "set_blas_threads"]

MAX_ROWS = 64

_blas_setters = None  # per BLAS library loaded (numpy's OpenBLAS): the function that sets its thread count


def set_blas_threads(count: int) -> None:
    """OpenBLAS's thread count for the calling thread's calls (a few microseconds: fine before every pass).

    OpenBLAS (0.3.27 on) keeps a count per calling thread, and a thread other than the main one
    ignores the process-wide count that threadpoolctl sets; so where the library has the per-thread
    setter, that is used, through threadpoolctl's handle on the library.
    """
    global _blas_setters
    if _blas_setters is None:
        libraries = ThreadpoolController().select(user_api="blas").lib_controllers
        _blas_setters = [getattr(library.dynlib, "openblas_set_num_threads_local", library.set_num_threads)
                         for library in libraries]
    for setter in _blas_setters:
        setter(count)


class BatchedLinears:
    """Input-major copies of a module's linear weights (float32, CPU), and the linear that uses them."""

    max_rows = MAX_ROWS

    def __init__(self, module: nn.Module):
        if not self.supported(module):
            raise ValueError("batched linear layers need float32 weights on the CPU")
        self._transposed = {id(linear): linear.weight.detach().t().contiguous().numpy()
                            for linear in module.modules() if isinstance(linear, nn.Linear)}

    @staticmethod
    def supported(module: nn.Module) -> bool:
        """Float32 on the CPU, with nn.Linear layers to copy (a quantized module has none: its
        layers' own kernels serve batched passes, and no copy is kept)."""
        has_linears = any(isinstance(linear, nn.Linear) for linear in module.modules())
        return has_linears and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in module.parameters())

    @property
    def nbytes(self) -> int:
        return sum(weight.nbytes for weight in self._transposed.values())

    def __call__(self, linear: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """linear(rows) for rows [n, in]; autograd, and a layer without a copy, go through the layer itself."""
        weight_t = self._transposed.get(id(linear))
        if weight_t is None or (rows.requires_grad and torch.is_grad_enabled()):
            return linear(rows)
        output = torch.from_numpy(np.matmul(rows.detach().contiguous().numpy(), weight_t))
        return output if linear.bias is None else output.add_(linear.bias)
