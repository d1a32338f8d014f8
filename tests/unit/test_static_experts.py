"""Static steps (blocks/step_graphs.py) of experts that cannot be stacked (SparseMoe.stack): quantized ones, and
float ones on a GPU in another dtype than bfloat16, compute every expert over all the pass's rows and keep each
row's chosen expert's output (SparseMoe._every_expert). What of it runs on the CPU: it equals the eager step, it
is taken only where the pass has rows enough for its reads (SparseMoe.static_refusal), and it reads nothing
back to the host and runs the same kernels on the same shapes at every position."""

import pytest
import torch

from bloompeer.blocks import Segment, quantize_block
from bloompeer.blocks.moe import SparseMoe
from bloompeer.blocks.step_graphs import StepGraphs, eager_reason, stack_experts
from bloompeer.weight_format import WeightFormat

from .test_step_graphs import (
    MOE_STATIC, _assert_graphed_steps_equal_eager, _cpu_replay, _HostInputs, _Kernels, _segment, _span,
    _static_step_on,
)

# What a GPU server's int8 experts compute (Int8Linear's CUDA arithmetic), and the CPU's int8 and 4-bit kernels
# (4-bit in groups of 32, for the tiny experts' 32 inputs; DeepSeek-V3's query LoRA of 24 outputs has no 4-bit form)
INT8_CUDA = WeightFormat.of("int8", device="cuda")
QUANTIZED = [("mixtral", INT8_CUDA), ("qwen2_moe", INT8_CUDA), ("qwen3_moe", INT8_CUDA), ("gpt_oss", INT8_CUDA),
             ("deepseek_v3 experts", INT8_CUDA), ("glm4_moe experts", INT8_CUDA),
             ("mixtral", WeightFormat.of("int8")), ("qwen3_moe", WeightFormat.of("int4", 32)),
             ("gpt_oss", WeightFormat.of("int4", 32))]


def _quantized_span(name: str, weights: WeightFormat):
    fields, start, end = MOE_STATIC[name]
    span = _span(name, fields, start, end)
    for block in span.blocks:
        quantize_block(block, weights)
    return span


def _sparse_mlps(span) -> list[SparseMoe]:
    return [module for module in span.modules() if isinstance(module, SparseMoe)]


@pytest.mark.parametrize("name, weights", QUANTIZED,
                         ids=[f"{name}-{weights.label}-{weights.device}" for name, weights in QUANTIZED])
@torch.inference_mode()
def test_quantized_experts_take_static_steps_equal_to_eager_ones(name, weights):
    """test_graphed_decode_steps_equal_eager_ones_in_float32's sessions and steps (3 rows a pass: rows enough for
    every expert count here) through quantized experts: captured and replayed, every output within 1e-6 of the
    eager span's."""
    span = _quantized_span(name, weights)
    _assert_graphed_steps_equal_eager(span, span.start, span.end)
    assert all(moe.stacked is None for moe in _sparse_mlps(span))


@pytest.mark.parametrize("name", sorted(MOE_STATIC))
@torch.inference_mode()
def test_float_experts_left_unstacked_compute_every_expert_in_a_static_step(name, monkeypatch):
    """Float experts that SparseMoe.stack leaves as they are (float32 ones on a GPU; on the CPU it stacks them,
    so here it is made to leave them) take the every-expert form too, equal to the eager step."""
    monkeypatch.setattr(SparseMoe, "stack", lambda moe: None)
    fields, start, end = MOE_STATIC[name]
    span = _span(name, fields, start, end)
    _assert_graphed_steps_equal_eager(span, start, end)
    assert all(moe.stacked is None for moe in _sparse_mlps(span))


def _decode(graphs: StepGraphs, batch: int) -> None:
    """A session of `batch` rows through 3 one-token passes of the whole span."""
    span = graphs.span
    cache = span.new_cache(span.start, span.end, batch, 8, torch.float32)
    for position in range(3):
        hidden = torch.full((batch, 1, span.config.hidden_size), 0.1 * position)
        graphs.forward([Segment(hidden, cache.begin_step(position, None, 1), cache)], span.start, span.end)


@torch.inference_mode()
def test_experts_not_stacked_take_a_static_step_only_with_rows_enough_for_their_number():
    """Qwen3-MoE's 8 experts, 3 a row, quantized: one row's static step would read all 8 where its eager pass
    reads at most 3, so it runs eagerly and says why; two rows (at most 6) take static steps. Stacked experts
    read only the chosen ones whatever the rows."""
    span = _quantized_span("qwen3_moe", INT8_CUDA)
    reason = eager_reason(span, [_segment(span)], 0, 2)
    assert "a mixture of experts: its 8 experts are not stacked" in reason
    assert "read all 8 of them, more than twice the 3 that an eager pass reads at most (1 row of 3 choices)" in reason
    assert eager_reason(span, [_segment(span), _segment(span)], 0, 2) is None
    assert eager_reason(span, [_segment(span, 2)], 0, 2) is None

    graphs = StepGraphs(span, capture=_cpu_replay)
    _decode(graphs, batch=1)
    assert graphs.counts == {"eager": 3, "capture": 0, "replay": 0}
    _decode(graphs, batch=2)  # the same blocks, refused for one row: not for two
    assert graphs.counts == {"eager": 4, "capture": 1, "replay": 1}

    fields, start, end = MOE_STATIC["qwen3_moe"]
    stacked = _span("qwen3_moe", fields, start, end)
    stack_experts(stacked)
    assert eager_reason(stacked, [_segment(stacked)], 0, 2) is None


def _quantized_static_step(name: str, device: str, position: int = 5):
    """A static step of the span's blocks with int8 experts, in bfloat16 (so their bfloat16 scales stay so)."""
    return _static_step_on(_quantized_span(name, INT8_CUDA), device, position, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3 experts"])
@torch.inference_mode()
def test_a_static_step_of_quantized_experts_reads_nothing_back_to_the_host(name):
    """On the meta device a tensor has no values: the eager pass's rows per expert (bincount, read with tolist)
    cannot be counted there, nor anything else read back; and after the warm-up the step touches no host tensor
    (test_step_graphs.py's two tests of the same)."""
    step, _cache = _quantized_static_step(name, "meta")
    step.run()
    with _HostInputs() as host_inputs:
        step.run()
    assert host_inputs.calls == []


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3 experts"])
@torch.inference_mode()
def test_a_static_step_of_quantized_experts_runs_the_same_kernels_at_every_position(name):
    """What a graph replays is what it captured (test_step_graphs.py's test of the same): every expert computed
    over every row at positions 3 and 11 alike, its output picked in for the rows that chose it."""
    traces = []
    for position in (3, 11):
        step, _cache = _quantized_static_step(name, "cpu", position)
        step.run()
        with _Kernels() as kernels:
            step.run()
        traces.append(kernels.calls)
    assert traces[0] == traces[1]
    picks = sum(len(moe.experts) - 1 for moe in _sparse_mlps(step.span))  # torch.where, for every expert but one
    assert sum(call.startswith("aten.where") for call, _ in traces[0]) == picks
