"""Quantized weights (int8, 4-bit): what they cost in quality and what they save in time, side by side
with float32 in the same run.

1. Kernels: one linear layer of the bloom-560m shape (1024 inputs, 4096 outputs) on one thread, for
   1, 8 and 512 rows: float32 F.linear (the baseline: MKL, what a request alone gets) and float32
   through oneDNN (what a batched pass gets, blocks/batched_linear.py) against int8 and 4-bit
   weights for every group size: forward time (median CPU time and min wall time), the output's error
   relative to float32's, the weights' bytes, and the backward (the input's gradient, 8 rows).
2. Quality: perplexity of the bundled demo model (6 BLOOM blocks) on its held-out text, computed
   locally with transformers' BloomForCausalLM whose blocks' linear layers are quantized by
   bloompeer.blocks.quantized_linear, for none / int8 / 4-bit at every group size, and the whole
   model cast to bfloat16 for comparison. Goals (issue 27): int8 within 0.5 % of float32, 4-bit
   within 2 %.

With --device cuda both run on the GPU, through CUDA's kernels: the layers are the bloom-560m one
and a Llama-3-8B MLP one (4096 inputs, 14336 outputs), timed with CUDA events (median and min
of the repeats), against bfloat16 F.linear (what `serve --device cuda --dtype bfloat16` computes)
and against the floor of reading the weights once at the copy bandwidth measured in the same run.

    python benchmarks/quantization.py [--skip-kernels] [--repeats N] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoTokenizer, BloomForCausalLM

from bloompeer.blocks.batched_linear import BatchedLinears
from bloompeer.blocks.quantized_linear import Int4Linear, Int8Linear, QuantizedLinear, quantize_block
from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR
from bloompeer.weight_format import INT4_GROUP_SIZES, WeightFormat

KERNEL_SHAPE = (1024, 4096)  # (in, out): bloom-560m's dense_h_to_4h
CUDA_KERNEL_SHAPES = [KERNEL_SHAPE, (4096, 14336)]  # and Llama-3-8B's up_proj, for a GPU's bandwidth
GOALS = {"int8": 0.005, "int4": 0.02}  # perplexity's relative increase over float32, at most


def quantized(weight_format: WeightFormat, linear: nn.Linear) -> nn.Module:
    """The layer stored as `weight_format` says (the float layer itself for none)."""
    if weight_format.quant == "int8":
        return Int8Linear(linear)
    return Int4Linear(linear, weight_format.group_size) if weight_format.quant == "int4" else linear


FORMATS = [WeightFormat("none"), WeightFormat("int8")] + [WeightFormat("int4", group) for group in INT4_GROUP_SIZES]
KERNEL_ROWS = (1, 8, 512)


class _OneDnnLinear(nn.Module):
    """Float32 through oneDNN on the layer's own weight, as a batched pass computes it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return BatchedLinears(self.linear)(self.linear, rows)


class _IntMmInt8(nn.Module):
    """int8 candidate: each row rounded to int8 with a scale of its own and multiplied in integers
    (torch._int_mm), then both scales; fast where the CPU has VNNI or AMX."""

    def __init__(self, layer: Int8Linear):
        super().__init__()
        self.weight_t, self.scales, self.bias = layer.weight_int8.t(), layer.scales.float(), layer.bias

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        row_scales = (rows.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        rows_int8 = torch.round(rows / row_scales).clamp_(-127, 127).to(torch.int8)
        return torch._int_mm(rows_int8, self.weight_t).float().mul_(row_scales).mul_(self.scales).add_(self.bias)


class _DynamicInt8(nn.Module):
    """int8 candidate: PyTorch's dynamically quantized linear (rows rounded to int8 per tensor at each call,
    int8 weights with a scale per output channel) prepacked for one quantized engine: onednn (oneDNN's
    int8 matmul), x86 or fbgemm."""

    def __init__(self, linear: nn.Linear, engine: str):
        super().__init__()
        self.engine = engine
        with _quantized_engine(engine):
            self.layer = torch.ao.quantization.quantize_dynamic(
                nn.Sequential(copy.deepcopy(linear)), {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig},
                dtype=torch.qint8, inplace=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        with _quantized_engine(self.engine):
            return self.layer(rows)


class _TiledInt8(nn.Module):
    """int8 candidate: the weights dequantized to float32 a tile of output channels at a time (a tile
    stays in cache) and multiplied there, so that memory sees only the int8 bytes."""

    def __init__(self, layer: Int8Linear, tile: int = 256):
        super().__init__()
        self.weight, self.scales, self.bias, self.tile = layer.weight_int8, layer.scales.float(), layer.bias, tile

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        parts = [rows @ (self.weight[i:i + self.tile].float() * self.scales[i:i + self.tile, None]).t()
                 for i in range(0, self.weight.shape[0], self.tile)]
        return torch.cat(parts, dim=1).add_(self.bias)


@contextlib.contextmanager
def _quantized_engine(engine: str):
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def int8_candidates(linear: nn.Linear) -> list[tuple[str, nn.Module]]:
    """The CPU int8 kernels measured beside the one blocks/quantized_linear.py uses (issue 42)."""
    layer = Int8Linear(linear)
    candidates = [("int8 _int_mm", _IntMmInt8(layer)), ("int8 tiled", _TiledInt8(layer))] + \
        [(f"int8 {engine}", _DynamicInt8(linear, engine))
         for engine in ("onednn", "x86", "fbgemm") if engine in torch.backends.quantized.supported_engines]
    for _, candidate in candidates:
        candidate.weight_nbytes = layer.weight_nbytes  # int8 weights and a scale per output channel
    return candidates


def timed_us(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median CPU time of this thread, min wall time) of `repeats` calls in microseconds, after a few
    warm-up calls. The kernels run on this thread alone (one thread), so its CPU time leaves out the
    time it waited for a core on a shared machine, which wall time does not."""
    for _ in range(3):
        fn()
    cpu, wall = [], []
    for _ in range(repeats):
        cpu_start, wall_start = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    return 1e6 * statistics.median(cpu), 1e6 * min(wall)


def cuda_timed_us(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, min) GPU time of `repeats` calls in microseconds, each between two CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return statistics.median(times), min(times)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes per second a device-to-device copy moves, counting what it reads and what it writes."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    _, best_us = cuda_timed_us(lambda: target.copy_(source), 20)
    return 2 * nbytes / (best_us * 1e-6)


def cuda_kernel_table(repeats: int, device: torch.device) -> None:
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    print(f"Kernels on {torch.cuda.get_device_name(device)}, {repeats} repeats, CUDA events; copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s; floor: the weights' bytes read once at that bandwidth; error is "
          f"|y - y_float32| / |y_float32|")
    print(f"{'shape':<11} {'weights':<12} {'bytes':>10} {'rows':>4} {'median us':>10} {'min us':>8} "
          f"{'vs bf16':>8} {'floor us':>9} {'rel. error':>11}")
    for in_features, out_features in CUDA_KERNEL_SHAPES:
        linear = nn.Linear(in_features, out_features, device=device).requires_grad_(False)
        nn.init.normal_(linear.weight, std=in_features**-0.5)
        bfloat16 = copy.deepcopy(linear).to(torch.bfloat16)
        layers = [("none bf16", bfloat16, torch.bfloat16), ("none f32", linear, torch.float32)]
        layers += [(weight_format.label, quantized(weight_format, linear), torch.bfloat16)
                   for weight_format in FORMATS[1:] if weight_format.group_size in (0, 64, 128)]
        for rows in KERNEL_ROWS:
            inputs = torch.randn(rows, in_features, device=device)
            expected = linear(inputs)
            baseline = None  # the first layer's, bfloat16's
            for label, layer, dtype in layers:
                typed = inputs.to(dtype)
                median, best = cuda_timed_us(lambda: layer(typed), repeats)
                baseline = baseline or median
                error = float((layer(typed).float() - expected).norm() / expected.norm())
                size = layer.weight_nbytes if isinstance(layer, QuantizedLinear) else layer.weight.nbytes
                print(f"{in_features}x{out_features:<6} {label:<12} {size:>10} {rows:>4} {median:>10.1f} "
                      f"{best:>8.1f} {median / baseline:>8.2f} {1e6 * size / bandwidth:>9.1f} {error:>11.2e}")


def kernel_table(repeats: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    in_features, out_features = KERNEL_SHAPE
    linear = nn.Linear(in_features, out_features).requires_grad_(False)
    nn.init.normal_(linear.weight, std=in_features**-0.5)
    print(f"Kernels: one {in_features}x{out_features} layer (random normal weights), 1 thread, "
          f"{repeats} repeats; error is |y - y_float32| / |y_float32| over the rows")
    print(f"{'weights':<12} {'bytes':>9} {'rows':>4} {'CPU us':>9} {'wall min':>9} {'vs f32':>7} {'rel. error':>11} "
          f"{'backward CPU us':>16}")
    for rows in KERNEL_ROWS:
        inputs = torch.randn(rows, in_features)
        expected = linear(inputs)
        layers = [("none", linear), ("none oneDNN", _OneDnnLinear(linear))]
        layers += [(weight_format.label, quantized(weight_format, linear)) for weight_format in FORMATS[1:]]
        candidates = int8_candidates(linear)
        layers += candidates
        baseline = None
        for label, layer in layers:
            cpu, wall = timed_us(lambda: layer(inputs), repeats if rows < 64 else max(5, repeats // 20))
            baseline = baseline or cpu
            error = float((layer(inputs) - expected).norm() / expected.norm())
            differentiable = rows == 8 and (label, layer) not in candidates
            backward = timed_us(lambda: _input_gradient(layer, inputs), max(10, repeats // 10))[0] if differentiable else None
            size = getattr(layer, "weight_nbytes", linear.weight.nbytes)
            print(f"{label:<12} {size:>9} {rows:>4} {cpu:>9.0f} {wall:>9.0f} {cpu / baseline:>7.2f} {error:>11.2e} "
                  f"{'' if backward is None else f'{backward:.0f}':>16}")


def _input_gradient(layer: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    rows = inputs.detach().requires_grad_()
    output = layer(rows)
    (grad,) = torch.autograd.grad(output, rows, torch.ones_like(output))
    return grad


def heldout_ids(device: torch.device) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    text = (DEMO_MODEL_DIR / "heldout.txt").read_text(encoding="utf-8")
    return tokenizer(text, return_tensors="pt").input_ids.to(device)


def local_model(weight_format: WeightFormat, base: BloomForCausalLM) -> BloomForCausalLM:
    """The demo model with every block's linear layers stored as `weight_format` (embeddings, norms and
    the LM head stay float32), quantized block by block as a server would."""
    model = copy.deepcopy(base)
    for block in model.transformer.h:
        quantize_block(block, weight_format)
    return model


@torch.inference_mode()
def perplexity(model: BloomForCausalLM, ids: torch.Tensor) -> float:
    return math.exp(model(ids, labels=ids).loss.item())


def quality_table(device: torch.device) -> None:
    ids = heldout_ids(device)
    base = BloomForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval().to(device)
    print(f"\nQuality: demo model ({base.config.n_layer} blocks, hidden {base.config.hidden_size}), "
          f"heldout.txt ({ids.shape[1]} tokens), perplexity computed locally on {device}")
    print(f"{'weights':<22} {'perplexity':>10} {'vs float32':>11} {'goal':>7}")
    reference = perplexity(base, ids)
    for weight_format in FORMATS:
        value = reference if not weight_format.quantized else perplexity(local_model(weight_format, base), ids)
        goal = GOALS.get(weight_format.quant)
        verdict = "" if goal is None else ("met" if value <= reference * (1 + goal) else "MISSED")
        print(f"{weight_format.label:<22} {value:>10.3f} {value / reference - 1:>+11.2%} {verdict:>7}")
    whole_bfloat16 = perplexity(copy.deepcopy(base).to(torch.bfloat16), ids)
    print(f"{'whole model bfloat16':<22} {whole_bfloat16:>10.3f} {whole_bfloat16 / reference - 1:>+11.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-kernels", action="store_true", help="print only the quality table")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per kernel and row count")
    parser.add_argument("--device", default="cpu", help="cpu (the default) or cuda, cuda:1, ...")
    args = parser.parse_args()
    device = torch.device(args.device)
    if not args.skip_kernels:
        if device.type == "cuda":
            cuda_kernel_table(args.repeats, device)
        else:
            kernel_table(args.repeats)
    quality_table(device)


if __name__ == "__main__":
    main()
