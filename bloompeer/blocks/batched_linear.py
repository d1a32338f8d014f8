"""The linear layers of a pass that batches several sessions' rows, through oneDNN, on the weights
themselves (no copy).

Why another kernel than a request alone gets: on the CPUs we serve from, MKL's float32 GEMM for 2
to 64 rows is far slower per row than its GEMV for one, so a batched pass cost almost what its
sessions cost one after another. oneDNN's matmul (torch.ops.mkldnn._linear_pointwise, what
torch.compile's CPU path calls) reads the same [out, in] weight that F.linear does. The 48 linear
layers of 12 blocks of hidden 1024, on one thread (median CPU time, 2-core machine shared with
other work): 1 row 32.8 ms with MKL; 8 rows 69.2 ms with MKL, 59.1 with OpenBLAS on a second,
input-major copy of the weights (what was used before), 40.9 with oneDNN on the weights
themselves; 64 rows 230.5, 193.8 and 109.4. With oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2),
8 rows took 63.3 ms against 57.6 for the copy: on such a CPU the memory saved costs some speed.

One request alone keeps MKL through F.linear (span.py), so it still gives transformers' values to
the bit. A batched pass was never bitwise equal to its requests computed alone (MKL's 8-row GEMM
is not either); it stays within float32 rounding of them.

Above MAX_ROWS (long prompts batched together) the pass runs on every thread, and MKL is used.

oneDNN builds (and keeps, in its primitive cache) a kernel of about 0.6 MiB for each shape of rows x
weight it meets: every row count from 2 to 64 times a block's 4 weight shapes grew a server by 147 MiB,
which read as a leak of its sessions. So rows are padded to one of 14 counts (each up to 8, then
multiples of 8; at most 7 rows of zeros, a few percent of a weight-bound pass), and the kernels of
those counts are built when a span takes batched linears, so a server's memory stays flat from its
start: 32 MiB at that width, counted in its fixed overhead.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BatchedLinears"]

MAX_ROWS = 64
EXACT_ROWS = 8  # row counts up to this one run as they are; larger ones are padded to multiples of it


class BatchedLinears:
    """The linear layer of batched passes (oneDNN on each layer's own float32 weight, CPU); keeps nothing."""

    max_rows = MAX_ROWS

    def __init__(self, module: nn.Module):
        if not self.supported(module):
            raise ValueError("batched linear layers need float32 nn.Linear weights on the CPU, and oneDNN")
        _build_kernels(module)

    @staticmethod
    def supported(module: nn.Module) -> bool:
        """Float32 on the CPU, with nn.Linear layers (a quantized module has none: its layers' own
        kernels serve batched passes), and a torch built with oneDNN."""
        has_linears = any(isinstance(linear, nn.Linear) for linear in module.modules())
        return (has_linears and torch.backends.mkldnn.is_available()
                and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in module.parameters()))

    def __call__(self, linear: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """linear(rows) for rows [n, in]; autograd, and a layer that is not nn.Linear, go through the layer itself."""
        if not isinstance(linear, nn.Linear) or (rows.requires_grad and torch.is_grad_enabled()):
            return linear(rows)
        return _onednn_linear(linear, rows)


def padded_rows(count: int) -> int:
    """The row count a pass of `count` rows runs with: one of few, so that oneDNN builds few kernels."""
    return count if count <= EXACT_ROWS else -(-count // EXACT_ROWS) * EXACT_ROWS


def _onednn_linear(linear: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    count = rows.shape[0]
    if padded_rows(count) != count:
        rows = torch.cat([rows, rows.new_zeros(padded_rows(count) - count, rows.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(rows, linear.weight, linear.bias, "none", [], "")[:count]


def _build_kernels(module: nn.Module) -> None:
    """Run each weight shape of the module once per padded row count (its blocks share their shapes)."""
    linears = {(m.weight.shape, m.bias is not None): m for m in module.modules() if isinstance(m, nn.Linear)}
    counts = sorted({padded_rows(count) for count in range(2, MAX_ROWS + 1)})
    with torch.no_grad():
        for linear in linears.values():
            for count in counts:
                _onednn_linear(linear, linear.weight.new_zeros(count, linear.in_features))
