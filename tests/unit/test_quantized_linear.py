"""Quantized linear layers (int8, 4-bit) against the same arithmetic done by hand in float, alone and
inside a BLOOM and a Qwen3 (Llama family) span computed by BlockSpan.

The tolerance of a layer's output is derived, not tuned. The kernel and the hand computation both
take the bfloat16-rounded input and the same dequantized weight and sum in float32, in different
orders: the two sums differ by at most 2 * gamma_K * sum_k |x_k w_k| (gamma_K = K u / (1 - K u),
u = 2^-24, the classic bound for a float32 dot product of K terms). Each side is then rounded to
bfloat16 (unit roundoff 2^-8), and the bias added in float32. So, element by element,
|ours - hand| <= 2 gamma_K sum|x||w| + 2^-8 (|ours| + |hand|) + 2^-23 (|ours| + |hand|).
A wrong scale, zero, packing or group would miss that by orders of magnitude.

The tests run on the CPU, and on a GPU with BLOOMPEER_TEST_DEVICE=cuda (scripts/device_check.sh):
there int8 is CUDA's weight-only arithmetic (F.linear on the integer weights, then the scales) and
4-bit goes through CUDA's own packing and kernel, which
dequantizes in bfloat16 (aten/src/ATen/native/cuda/int4mm.cu: one bfloat16 fma per weight), so each
weight may move by one bfloat16 rounding (2^-8 of itself) from the float32 that the CPU uses, and
its tensor cores may truncate where the CPU rounds (u = 2^-23).
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BloomConfig, Qwen3Config

from bloompeer.blocks import BlockSpan, Segment
from bloompeer.blocks.bloom import BloomSpan
from bloompeer.blocks.llama import LlamaSpan
from bloompeer.blocks.quantized_linear import (
    Int4Linear, Int8Linear, QuantizedLinear, check_int4_shape, check_kernels, quantize_block, quantize_linears,
)
from bloompeer.weight_format import INT4_GROUP_SIZES, WeightFormat

DEVICE = torch.device(os.environ.get("BLOOMPEER_TEST_DEVICE", "cpu"))
ON_CUDA = DEVICE.type == "cuda"
IN_FEATURES, OUT_FEATURES = 256, 192
BLOCK_CONFIG = BloomConfig(vocab_size=100, hidden_size=64, n_layer=2, n_head=4)
SPANS = {  # a span of each family: its class, and a config the 4-bit kernels take (widths multiples of 64)
    "bloom": (BloomSpan, BLOCK_CONFIG),
    "qwen3": (LlamaSpan, Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}


@pytest.fixture(scope="module")
def float_layer() -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(IN_FEATURES, OUT_FEATURES)
    with torch.no_grad():
        layer.weight.normal_(std=0.05)
        layer.weight[3, 7] = 0.9  # an outlier, as trained models have: its group's or row's scale is wide
        layer.weight[5] = 0.0  # a row of zeros: a zero scale must not divide by zero
    return layer.requires_grad_(False).to(DEVICE)


def hand_dequantized(layer: QuantizedLinear, weight: torch.Tensor) -> torch.Tensor:
    """W_deq from the format's definition, independently of how the layer packs or reads back q:
    int8: q * scale; 4-bit: q = round((w - zero) / scale) + 8 clipped to [0, 15], (q - 8) * scale + zero."""
    if isinstance(layer, Int8Linear):
        return layer.weight_int8.float() * layer.scales.float()[:, None]
    groups = weight.float().view(weight.shape[0], -1, layer.group_size)
    scales, zeros = layer.scales_and_zeros.float().permute(2, 1, 0)[..., None]  # [out, groups, 1]
    q = torch.round((groups - zeros) / scales).add(8).clamp(0, 15)
    return ((q - 8) * scales + zeros).view_as(weight)


def kernel_dequantized(layer: QuantizedLinear, weight: torch.Tensor) -> torch.Tensor:
    """The W_deq that the layer's kernel computes with: the format's (hand_dequantized), except that
    CUDA's 4-bit kernel rounds it to bfloat16. That one is taken from the layer, whose agreement with
    the format's within that rounding a test checks: rounding the hand value to bfloat16 here could
    round a near-tie the other way (the hand value is itself rounded to float32 first)."""
    if ON_CUDA and isinstance(layer, Int4Linear):
        return layer.dequantized_weight()
    return hand_dequantized(layer, weight)


INT8_ARITHMETIC = "int8-cuda" if ON_CUDA else "int8-cpu"  # what Int8Linear computes on DEVICE


def arithmetic(kind: str) -> str:
    """How a layer of `kind` computes on DEVICE: the names hand_output takes."""
    return INT8_ARITHMETIC if kind == "int8" else kind


def hand_output(rows: torch.Tensor, dequantized: torch.Tensor, bias: torch.Tensor, how: str) -> torch.Tensor:
    """int8-cpu and int4: bfloat16 input, float32 product rounded to bfloat16 as the kernels' output is;
    int8-cuda: the float32 product with the dequantized weight. Plus the bias; the roundings pass
    gradients straight through, as the layer's backward does."""
    if how == "int8-cuda":
        output = F.linear(rows.float(), dequantized)
    else:
        output = _bfloat16_rounded(F.linear(_bfloat16_rounded(rows), dequantized))
    return output if bias is None else output + bias


def _bfloat16_rounded(values: torch.Tensor) -> torch.Tensor:
    return values + (values.bfloat16().float() - values).detach()


def assert_within_derived_bound(ours, hand, rows, dequantized, how):
    """int8-cpu and int4: both sides sum the bfloat16 inputs in float32 in different orders (2 gamma_K),
    the hand side's q * scale is rounded and ours scales its sum (int8-cpu: 2u), and both round to
    bfloat16 (2^-9 each). int8-cuda: both sides sum in float32 in different orders (2 gamma_K), the
    hand side's q * scale is rounded (u), and ours scales its sum (u); outputs in bfloat16 add their
    two roundings (its sum, then scaled)."""
    terms, u = rows.shape[-1], 2**-23 if ON_CUDA else 2**-24
    gamma = terms * u / (1 - terms * u)
    in_bfloat16 = ours.dtype == torch.bfloat16 and how == "int8-cuda"
    rows, ours = rows.float(), ours.float()
    if how == "int8-cuda":
        magnitude = F.linear(rows.abs(), dequantized.abs())
        bound = (2 * gamma + u) * magnitude + (2**-8 if in_bfloat16 else 2 * u) * (ours.abs() + hand.abs())
    else:
        magnitude = F.linear(rows.bfloat16().float().abs(), dequantized.abs())
        bound = (2 * gamma + 2 * u) * magnitude + (2**-8 + 2**-23) * (ours.abs() + hand.abs())
    excess = (ours - hand).abs() - bound
    assert excess.max() <= 0, f"{(excess > 0).sum()} outputs beyond the bound, worst by {excess.max():.3g}"


def quantized(kind: str, layer: nn.Linear, group_size: int = 64) -> QuantizedLinear:
    return Int8Linear(layer) if kind == "int8" else Int4Linear(layer, group_size)


KINDS = [("int8", 64)] + [("int4", group) for group in INT4_GROUP_SIZES]
KIND_IDS = ["int8"] + [f"int4-g{group}" for group in INT4_GROUP_SIZES]


@pytest.mark.parametrize(("kind", "group_size"), KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("shape", [(1, IN_FEATURES), (8, IN_FEATURES), (2, 150, IN_FEATURES)],
                         ids=["1-row", "8-rows", "prefill"])
@torch.no_grad()
def test_output_is_the_same_arithmetic_done_by_hand(float_layer, kind, group_size, shape):
    layer = quantized(kind, float_layer, group_size)
    dequantized = kernel_dequantized(layer, float_layer.weight)
    torch.manual_seed(1)
    rows = torch.randn(shape).to(DEVICE)
    ours = layer(rows)
    assert ours.shape == (*shape[:-1], OUT_FEATURES) and ours.dtype == torch.float32
    hand = hand_output(rows, dequantized, float_layer.bias, arithmetic(kind))
    assert_within_derived_bound(ours, hand, rows, dequantized, arithmetic(kind))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["int8-cpu", "int8-cuda"])
@torch.no_grad()
def test_each_int8_arithmetic_is_the_one_done_by_hand(float_layer, how, dtype):
    """Both, wherever the tests run (CUDA's too in CI): the CPU's weight-only kernel, CUDA's GEMM."""
    layer = Int8Linear(float_layer)
    dequantized = hand_dequantized(layer, float_layer.weight)
    torch.manual_seed(1)
    rows = torch.randn(8, IN_FEATURES).to(DEVICE, dtype)
    matmul = layer.cpu_matmul if how == "int8-cpu" else layer.cuda_matmul
    ours = matmul(rows)
    assert ours.dtype == dtype
    hand = hand_output(rows.float(), dequantized, None, how)
    assert_within_derived_bound(ours, hand, rows, dequantized, how)


@pytest.mark.parametrize(("kind", "group_size"), KINDS, ids=KIND_IDS)
def test_dequantized_weight_is_the_formats_and_each_weight_within_half_a_step(float_layer, kind, group_size):
    layer = quantized(kind, float_layer, group_size)
    dequantized = hand_dequantized(layer, float_layer.weight)
    if ON_CUDA and kind == "int4":  # one bfloat16 rounding of the hand value (itself rounded to float32)
        assert ((layer.dequantized_weight() - dequantized).abs() <= (2**-8 + 2**-23) * dequantized.abs()).all()
    else:
        assert torch.equal(layer.dequantized_weight(), dequantized)
    if kind == "int8":
        steps = layer.scales.float()[:, None].expand_as(dequantized)
    else:
        steps = layer.scales_and_zeros[..., 0].float().t().repeat_interleave(group_size, dim=1)
    # half a step, plus what rounding the scale and zero to bfloat16 may shift the grid's ends by
    slack = 2**-8 * (float_layer.weight.abs() + 8 * steps)
    assert ((dequantized - float_layer.weight).abs() <= steps / 2 + slack).all()
    assert torch.equal(dequantized[5], torch.zeros(IN_FEATURES, device=DEVICE))


def test_4bit_weights_read_through_the_kernel_equal_the_unpacked_ones_in_bfloat16(float_layer):
    """The path that CUDA's packing (not read back) and unknown CPU packings take."""
    if ON_CUDA:
        pytest.skip("CUDA's packing is not read back: every test above reads its weights through the kernel")
    layer = Int4Linear(float_layer, 64)
    assert layer._unpackable  # this CPU's packing is read back
    unpacked = layer.dequantized_weight()
    layer._unpackable = False
    assert torch.equal(layer.dequantized_weight(), unpacked.bfloat16().float())


@pytest.mark.parametrize(("kind", "group_size", "through_kernel"),
                         [("int8", 64, False), ("int4", 32, False), ("int4", 32, True)],
                         ids=["int8", "int4-unpacked", "int4-through-kernel"])
def test_backward_gives_the_input_gradient_of_the_dequantized_layer(float_layer, kind, group_size, through_kernel):
    layer = quantized(kind, float_layer, group_size)
    if through_kernel:
        layer._unpackable = False
    dequantized = hand_dequantized(layer, float_layer.weight)
    torch.manual_seed(2)
    rows = torch.randn(2, 3, IN_FEATURES).to(DEVICE).requires_grad_()
    grad = torch.randn(2, 3, OUT_FEATURES).to(DEVICE)
    (ours,) = torch.autograd.grad(layer(rows), rows, grad)
    reference_rows = rows.detach().requires_grad_()
    (expected,) = torch.autograd.grad(F.linear(reference_rows, dequantized, float_layer.bias), reference_rows, grad)
    if through_kernel or (ON_CUDA and kind == "int4"):  # weights rounded to bfloat16: each term off by 2^-8
        bound = 2**-8 * (grad.abs() @ dequantized.abs()) + 1e-6
        assert ((ours - expected).abs() <= bound).all()
    else:  # the same float32 product in the same kernel
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


def test_quantize_linears_reports_the_bytes_saved_and_refuses_what_the_kernels_cannot_take(float_layer):
    block = nn.Sequential(copy.deepcopy(float_layer), nn.LayerNorm(OUT_FEATURES))
    weights = IN_FEATURES * OUT_FEATURES
    assert quantize_linears(block, "none") == 0 and isinstance(block[0], nn.Linear)
    assert quantize_linears(copy.deepcopy(block), "int8") == 4 * weights - (weights + 2 * OUT_FEATURES)
    groups = IN_FEATURES // 64 * OUT_FEATURES
    assert quantize_linears(block, "int4", 64) == 4 * weights - (weights // 2 + 4 * groups)
    assert isinstance(block[0], Int4Linear) and block[1].weight.dtype == torch.float32  # norms stay
    with pytest.raises(ValueError, match="none, int8, int4"):
        quantize_linears(block, "nf4")
    for in_features, out_features, group_size in [(256, 192, 48), (96, 192, 64), (256, 200, 64)]:
        with pytest.raises(ValueError):
            check_int4_shape(in_features, out_features, group_size)


def test_int8_computes_as_its_device_does_unless_told_to_compute_as_cuda(float_layer):
    """A client checking a CUDA server's int8 output on its CPU computes CUDA's way (verification.py)."""
    block = nn.Sequential(copy.deepcopy(float_layer))
    quantize_linears(block, "int8")
    assert block[0].cuda_arithmetic == ON_CUDA
    as_cuda = nn.Sequential(copy.deepcopy(float_layer))
    quantize_linears(as_cuda, "int8", int8_cuda_arithmetic=True)
    rows = torch.randn(3, IN_FEATURES, device=DEVICE)
    assert as_cuda[0].cuda_arithmetic and torch.equal(as_cuda[0].matmul(rows), as_cuda[0].cuda_matmul(rows))
    for device, cuda_arithmetic in (("cuda", True), ("cpu", False)):  # the one hook of servers and clients alike
        block = nn.Sequential(copy.deepcopy(float_layer))
        quantize_block(block, WeightFormat("int8", device=device))
        assert block[0].cuda_arithmetic is cuda_arithmetic


def test_4bit_weights_refuse_to_run_on_another_device_than_they_were_packed_for(float_layer):
    layer = Int4Linear(float_layer, 64)
    elsewhere = "cpu" if ON_CUDA else "cuda"
    layer.device_type = elsewhere  # as if packed there: one device's packing means nothing to another's kernel
    with pytest.raises(RuntimeError, match=f"packed for {elsewhere}"):
        layer(torch.randn(1, IN_FEATURES, device=DEVICE))


@pytest.mark.parametrize(("kind", "group_size"), KINDS, ids=KIND_IDS)
def test_the_start_up_check_passes_these_kernels_and_fails_one_computing_something_else(kind, group_size,
                                                                                       monkeypatch):
    check_kernels(kind, DEVICE, group_size)
    layer_class = Int8Linear if kind == "int8" else Int4Linear
    right = layer_class.matmul
    monkeypatch.setattr(layer_class, "matmul", lambda self, rows: right(self, rows).flip(-1))  # outputs swapped
    with pytest.raises(RuntimeError, match=f"off the float result, where {kind} stays within"):
        check_kernels(kind, DEVICE, group_size)


class _HandLinear(nn.Module):
    """The hand arithmetic as a module, to stand where a quantized layer stands in a span."""

    def __init__(self, dequantized: torch.Tensor, bias: torch.Tensor, kind: str):
        super().__init__()
        self.dequantized, self.bias, self.kind = dequantized, bias, kind

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return hand_output(rows, self.dequantized, self.bias, arithmetic(self.kind))


def _quantized_span_and_hand_reference(kind: str, family: str) -> tuple[BlockSpan, BlockSpan, BlockSpan]:
    """The same random blocks three times: quantized, computed by hand, in float32."""
    torch.manual_seed(3)
    span_class, config = SPANS[family]
    float_span = span_class(config, 0, 2).eval().requires_grad_(False).to(DEVICE)
    with torch.no_grad():
        for parameter in float_span.parameters():  # Llama-family blocks start with unit norms and no init
            parameter.copy_(torch.randn_like(parameter) * 0.1 + (0.0 if parameter.ndim > 1 else 1.0))
    span, reference = copy.deepcopy(float_span), copy.deepcopy(float_span)
    for block, reference_block in zip(span.blocks, reference.blocks):
        floats = {name: module for name, module in block.named_modules() if isinstance(module, nn.Linear)}
        quantize_linears(block, kind)
        for name, layer in block.named_modules():
            if isinstance(layer, QuantizedLinear):
                parent, _, child = name.rpartition(".")
                hand = _HandLinear(kernel_dequantized(layer, floats[name].weight), layer.bias, kind)
                setattr(reference_block.get_submodule(parent), child, hand)
    return span, reference, float_span


@pytest.mark.parametrize("family", SPANS)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_span_computes_the_hand_arithmetic_alone_batched_and_backward(kind, family):
    span, reference, float_span = _quantized_span_and_hand_reference(kind, family)
    layers = [module for module in span.modules() if isinstance(module, (nn.Linear, QuantizedLinear))]
    per_block = {"bloom": 4, "qwen3": 7}[family]  # fused qkv, dense, two MLP; q, k, v, o, gate, up, down
    assert len(layers) == per_block * span.num_blocks and all(isinstance(layer, QuantizedLinear) for layer in layers)
    assert not span.use_batched_linears() and span.batched_linears is None  # its layers compute themselves
    torch.manual_seed(4)
    hidden = torch.randn(2, 5, BLOCK_CONFIG.hidden_size).to(DEVICE)
    mask = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    mask[0, :2] = False

    def one_flipped_rounding(expected):
        """What one bfloat16 rounding that the kernel's summation order tips the other way moves an
        output by, through the residual stream: an ulp, at most 2^-7 of the largest value."""
        return 2**-7 * expected.abs().max().item()

    with torch.no_grad():
        ours, hand = span(hidden, mask), reference(hidden, mask)
        torch.testing.assert_close(ours, hand, rtol=0, atol=one_flipped_rounding(hand))
        if kind == "int4":  # int8's difference from float32 is too small at these widths to tell apart
            assert (ours - float_span(hidden, mask)).abs().max() > 3 * one_flipped_rounding(hand)
        steps = [torch.randn(1, 1, BLOCK_CONFIG.hidden_size).to(DEVICE),
                 torch.randn(3, 2, BLOCK_CONFIG.hidden_size).to(DEVICE)]
        batched = span.forward_segments([Segment(step) for step in steps])
        for step, output in zip(steps, batched):
            alone = span(step)
            torch.testing.assert_close(output, alone, rtol=0, atol=one_flipped_rounding(alone))
    rows, grad = hidden.clone().requires_grad_(), torch.randn_like(hidden)
    (ours_grad,) = torch.autograd.grad(span(rows, mask), rows, grad)
    (hand_grad,) = torch.autograd.grad(reference(rows, mask), rows, grad)
    torch.testing.assert_close(ours_grad, hand_grad, rtol=0, atol=one_flipped_rounding(hand_grad))
