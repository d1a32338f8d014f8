"""CUDA graphs' decode steps (blocks/step_graphs.py), what of them runs on the CPU: the static step that a graph
captures equals the eager step in float32 for every family layout it serves; which passes run eagerly; which
sets of sessions get a graph; and that the static step reads nothing back to the host and runs the same
kernels on the same shapes at every position (what makes one capture valid for every later step). The
capture and replay themselves run only on a GPU (tests/device/test_step_graphs_cuda.py)."""

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bloompeer.blocks import Segment, quantize_block
from bloompeer.blocks.step_graphs import GraphKeys, StaticStep, StepGraphs, eager_reason, kv_bucket, stack_experts
from bloompeer.weight_format import WeightFormat

from ..conftest import DEEPSEEK_FAMILY, LLAMA_FAMILY, MOE_FAMILY, QWEN3_NEXT
from ..helpers.tiny_spans import HIDDEN, random_span


def _span(name: str, fields: dict, start: int, end: int):
    return random_span(fields.get("model_type", name.split()[0]), fields, start, end)


# Every layout a graph serves, two blocks of each: ALiBi (BLOOM), grouped-query attention (Llama), Qwen2's
# biases and window (block 2 slides, block 1 not), dynamic rope grown past its trained length of 8, DeepSeek-V3's latent cache (its dense block 0: the others
# are experts), GLM-4.5's partial rotary, q/k norms and head_dim of 32 (its dense block 0 likewise).
DYNAMIC_ROPE = dict(max_position_embeddings=8, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
STATIC = {"bloom": ({}, 0, 2), "llama": (LLAMA_FAMILY["llama"], 0, 2), "qwen2": (LLAMA_FAMILY["qwen2"], 1, 3),
          "llama dynamic rope": (DYNAMIC_ROPE, 0, 2),
          "deepseek_v3": (DEEPSEEK_FAMILY["deepseek_v3"], 0, 1), "glm4_moe": (DEEPSEEK_FAMILY["glm4_moe"], 0, 1)}
# Mixtures of experts, their experts stacked as StepGraphs does (SparseMoe.stack): Mixtral's float32 weights,
# Qwen2-MoE's gated shared expert, Qwen3-MoE's 3 of 8 beside a dense block, gpt-oss's biased experts and
# sinks, DeepSeek-V3's group-limited router (block 1) after its dense block, GLM-4.5's likewise.
MOE_STATIC = {"mixtral": (MOE_FAMILY["mixtral"], 0, 2), "qwen2_moe": (MOE_FAMILY["qwen2_moe"], 0, 2),
              "qwen3_moe": (MOE_FAMILY["qwen3_moe"], 0, 2), "gpt_oss": (MOE_FAMILY["gpt_oss"], 0, 2),
              "deepseek_v3 experts": (DEEPSEEK_FAMILY["deepseek_v3"], 0, 2),
              "glm4_moe experts": (DEEPSEEK_FAMILY["glm4_moe"], 0, 2)}
STATIC |= MOE_STATIC
# Qwen3-Next's hybrid: 3 Gated DeltaNet blocks (block 1 with a dense MLP), then gated attention with experts.
RECURRENT = {"qwen3_next": (QWEN3_NEXT, 0, 4)}
MAX_LENGTH = 16


def _cpu_replay(step: StaticStep):
    """The CPU's stand-in for a CUDA graph: run the very function a graph captures, as a replay does."""
    step.run()  # as capture_cuda_graph's warm-up
    return step.run


@pytest.mark.parametrize("name", sorted(STATIC))
@torch.inference_mode()
def test_graphed_decode_steps_equal_eager_ones_in_float32(name):
    """Two sessions (batch 2 with left padding and max_length 16, batch 1 and max_length 12) after prompts of 5
    and 3 tokens, then 7 steps in one pass, the sessions in either order, through StepGraphs attending over
    8 entries, then 16 (12 for the second session) once the first holds 9 tokens: in each length, eager,
    captured on the second pass, replayed from the third. Each step's outputs are the eager span's within 1e-6
    of their largest value (rounding: the masked keys' exact zeros summed in), and every cache entry the first
    block writes is bitwise the eager one's. Past Qwen2's window of 5."""
    fields, start, end = STATIC[name]
    _assert_graphed_steps_equal_eager(_span(name, fields, start, end), start, end)


def _assert_graphed_steps_equal_eager(span, start: int, end: int) -> None:
    """The protocol of test_graphed_decode_steps_equal_eager_ones_in_float32 (its docstring), on any span."""
    graphs = StepGraphs(span, capture=_cpu_replay, min_kv_bucket=8)
    generator = torch.Generator().manual_seed(1)
    prompts = [(torch.randn(2, 5, HIDDEN, generator=generator), torch.tensor([[0, 0, 1, 1, 1], [1] * 5]).bool()),
               (torch.randn(1, 3, HIDDEN, generator=generator), None)]
    eager, graphed = ([span.new_cache(start, end, hidden.shape[0], max_length, torch.float32)
                       for (hidden, _), max_length in zip(prompts, (MAX_LENGTH, 12))] for _ in range(2))
    for caches in (eager, graphed):
        for cache, (hidden, mask) in zip(caches, prompts):
            span(hidden, cache.begin_step(0, mask, hidden.shape[1]), cache)
    worst = 0.0
    for step_index in range(7):
        new = [torch.randn(hidden.shape[0], 1, HIDDEN, generator=generator) for hidden, _ in prompts]
        expected = span.forward_segments(
            [Segment(hidden, cache.begin_step(cache.length, None, 1), cache) for hidden, cache in zip(new, eager)])
        segments = [Segment(hidden, cache.begin_step(cache.length, None, 1), cache) for hidden, cache in zip(new, graphed)]
        order = [0, 1] if step_index % 2 else [1, 0]
        outputs = graphs.forward([segments[i] for i in order], start, end)
        for i, output in zip(order, outputs):
            worst = max(worst, float((output - expected[i]).abs().max() / expected[i].abs().max()))
    assert graphs.counts == {"eager": 2, "capture": 2, "replay": 3}
    assert sorted(key[2] for key in graphs.keys.graphs) == [8, 16]
    assert worst <= 1e-6, worst
    for reference, cache in zip(eager, graphed):
        length = cache.length
        for ours, theirs in zip(cache._blocks[0], reference._blocks[0]):
            assert torch.equal(ours[:, :, :length], theirs[:, :, :length])


@torch.inference_mode()
def test_graphed_recurrent_steps_equal_eager_ones_and_roll_back_as_they_do():
    """Qwen3-Next's hybrid blocks, two sessions (prompts of 5 with left padding and of 3): 6 one-token steps,
    a speculative pass of 3 tokens, a step at its second position (2 drafts rejected: the states re-advance over
    the accepted token), 3 more steps. A graph's step reads the slots it was captured with, so each set of
    sessions has one graph per parity of its slots: the first two passes of each run eagerly, the next two are
    captured, and every later one-token step replays, the speculative pass and the re-advancing step run
    eagerly. Outputs within 1e-6 of the eager span's; the first Gated DeltaNet block's state and window, which
    only its own code computes, bitwise the eager one's, as are the positions its slots hold."""
    fields, start, end = RECURRENT["qwen3_next"]
    span = _span("qwen3_next", fields, start, end)
    graphs = StepGraphs(span, capture=_cpu_replay, min_kv_bucket=MAX_LENGTH)
    generator = torch.Generator().manual_seed(2)
    prompts = [(torch.randn(2, 5, HIDDEN, generator=generator), torch.tensor([[0, 0, 1, 1, 1], [1] * 5]).bool()),
               (torch.randn(1, 3, HIDDEN, generator=generator), None)]
    eager, graphed = ([span.new_cache(start, end, hidden.shape[0], MAX_LENGTH, torch.float32)
                       for hidden, _ in prompts] for _ in range(2))
    for caches in (eager, graphed):
        for cache, (hidden, mask) in zip(caches, prompts):
            span(hidden, cache.begin_step(0, mask, hidden.shape[1]), cache)
    worst = 0.0

    def step(num_new: int, back: int = 0) -> None:
        nonlocal worst
        new = [torch.randn(hidden.shape[0], num_new, HIDDEN, generator=generator) for hidden, _ in prompts]
        passes = []
        for caches in (eager, graphed):
            passes.append([Segment(hidden, cache.begin_step(cache.length - back, None, num_new), cache)
                           for hidden, cache in zip(new, caches)])
        expected = span.forward_segments(passes[0])
        for output, reference in zip(graphs.forward(passes[1], start, end), expected):
            worst = max(worst, float((output - reference).abs().max() / reference.abs().max()))

    for _ in range(6):
        step(1)
    step(3)
    step(1, back=2)
    for _ in range(3):
        step(1)
    assert graphs.counts == {"eager": 4, "capture": 2, "replay": 5}
    assert worst <= 1e-6, worst
    for reference, cache in zip(eager, graphed):
        ours, theirs = cache.recurrent._blocks[0], reference.recurrent._blocks[0]
        assert ours.positions == theirs.positions
        slot = ours.slot_at(cache.length)
        assert torch.equal(ours.states[slot], theirs.states[slot]) and torch.equal(ours.windows[slot], theirs.windows[slot])


def _segment(span, batch: int = 1, num_new: int = 1, prompts: bool = False, cache: bool = True) -> Segment:
    hidden = torch.zeros(batch, num_new, HIDDEN)
    kept = span.new_cache(span.start, span.end, batch, 8, torch.float32) if cache else None
    deep = torch.zeros(span.num_blocks, batch, 1, HIDDEN) if prompts else None
    return Segment(hidden, None, kept, deep)


@pytest.mark.parametrize("case, reason", [
    ("one-token steps", None),
    ("a prompt", "2 new tokens"),
    ("deep prompts", "deep prompts"),
    ("no cache", "without a cache"),
    ("nine sessions", "9 sessions in one pass: graphs take up to 8"),
    ("65 rows", "65 rows in one pass: graphs take up to 64"),
])
def test_what_runs_eagerly_is_decided_by_the_pass(span, case, reason):
    segments = {
        "one-token steps": lambda: [_segment(span, 2), _segment(span)],
        "a prompt": lambda: [_segment(span), _segment(span, num_new=2)],
        "deep prompts": lambda: [_segment(span, prompts=True)],
        "no cache": lambda: [_segment(span, cache=False)],
        "nine sessions": lambda: [_segment(span) for _ in range(9)],
        "65 rows": lambda: [_segment(span, 64), _segment(span)],
    }[case]()
    found = eager_reason(span, segments, span.start, span.end)
    assert found == reason if reason is None else reason in found


@pytest.mark.parametrize("name, fields, start, end, reason", [
    ("mixtral", MOE_FAMILY["mixtral"], 0, 2, None),  # 4 experts, 2 a row, not stacked: it computes all 4
    ("qwen3_moe", MOE_FAMILY["qwen3_moe"], 1, 2, None),  # its dense block 1 alone
    ("qwen3_moe", MOE_FAMILY["qwen3_moe"], 0, 2, "mixture of experts"),
    ("deepseek_v3", DEEPSEEK_FAMILY["deepseek_v3"], 0, 2, "mixture of experts"),
    ("qwen3_next", QWEN3_NEXT, 3, 4, None),  # gated attention with experts (4, 2 a row, all computed)
    ("llama", DYNAMIC_ROPE, 0, 4, None),  # its frequencies grow on the device
    ("llama", LLAMA_FAMILY["llama3-rope"], 0, 4, None),
])
def test_blocks_whose_family_reads_the_host_run_eagerly(name, fields, start, end, reason):
    span = _span(name, fields, start, end)
    found = eager_reason(span, [_segment(span)], start, end)
    assert found == reason if reason is None else reason in found


@torch.inference_mode()
def test_stacked_experts_are_views_of_one_tensor_and_compute_as_before():
    """SparseMoe.stack adds no memory (each expert's layer is a view of the stacked tensor) and changes nothing
    an eager pass computes; quantized experts are not stacked (a static step computes every one of them:
    tests/unit/test_static_experts.py)."""
    span = _span("mixtral", MOE_FAMILY["mixtral"], 0, 2)
    hidden = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(3))
    before = span(hidden, None)
    stack_experts(span)
    moe = span.blocks[0].block_sparse_moe
    weights, _ = moe.stacked[moe.experts[0].w1]
    assert all(expert.w1.weight.data_ptr() == weights[index].data_ptr() for index, expert in enumerate(moe.experts))
    assert torch.equal(span(hidden, None), before)
    assert eager_reason(span, [_segment(span)], 0, 2) is None

    quantized = _span("mixtral", MOE_FAMILY["mixtral"], 0, 2)
    for block in quantized.blocks:
        quantize_block(block, WeightFormat.of("int8"))
    StepGraphs(quantized, capture=_cpu_replay)
    assert all(block.block_sparse_moe.stacked is None for block in quantized.blocks)


@pytest.mark.parametrize("lengths, bucket", [([3], 64), ([64, 2], 64), ([65], 128), ([100, 900], 1024)])
def test_a_pass_attends_over_the_power_of_two_that_holds_its_longest_session(lengths, bucket):
    assert kv_bucket(lengths) == bucket


def test_a_set_of_sessions_is_captured_on_its_second_pass_and_the_least_recent_graph_goes_first():
    keys = GraphKeys(max_graphs=2, capture_on_pass=2)
    assert [keys.plan("a"), keys.plan("b"), keys.plan("a")] == ["eager", "eager", "capture"]
    keys.add("a", None, None)
    assert keys.plan("a") == "replay"
    keys.plan("b")
    keys.add("b", None, None)
    keys.plan("a")  # a is now the most recently used
    keys.plan("c")
    keys.add("c", None, None)
    assert list(keys.graphs) == ["a", "c"]
    assert keys.plan("b") == "eager"  # dropped with its count: seen anew


@torch.inference_mode()
def test_a_step_that_cannot_be_captured_runs_eagerly_and_so_do_all_after_it(span):
    def refuse(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = StepGraphs(span, capture=refuse)
    cache, reference = (span.new_cache(span.start, span.end, 1, 8, torch.float32) for _ in range(2))
    for position in range(3):
        hidden = torch.full((1, 1, span.config.hidden_size), 0.1 * position)
        expected = span(hidden, reference.begin_step(position, None, 1), reference)
        output, = graphs.forward([Segment(hidden, cache.begin_step(position, None, 1), cache)], span.start, span.end)
        assert torch.equal(output, expected)
    assert graphs.counts == {"eager": 2, "capture": 1, "replay": 0}
    assert "operation not permitted" in graphs.broken


@torch.inference_mode()
def test_a_graph_never_replays_over_a_freed_cache(span):
    cache = span.new_cache(span.start, span.end, 1, 8, torch.float32)
    step = StaticStep(span, [cache], span.start, span.end, torch.float32, kv_length=8)
    other = span.new_cache(span.start, span.end, 1, 8, torch.float32)
    assert step.holds([cache]) and not step.holds([other])
    del cache
    gc.collect()
    assert not step.holds([other])
    with pytest.raises(RuntimeError, match="freed"):
        step.run()


def _cache_at(span, position: int, device: str = "cpu", dtype=torch.float32):
    """A cache of 2 rows as after a prompt of `position` tokens (a recurrent state's in slot 0)."""
    cache = span.new_cache(span.start, span.end, 2, MAX_LENGTH, dtype, device)
    cache.length = position
    if cache.recurrent is not None:
        cache.recurrent.length = position
        for block in cache.recurrent._blocks.values():
            block.positions[0] = position
    return cache


def _static_step_on(span, device: str, position: int = 5, dtype=torch.float32) -> tuple[StaticStep, object]:
    """A static step at `position` (and its cache, which the step holds weakly), experts stacked as StepGraphs does."""
    span = span.to(device, dtype)
    stack_experts(span)
    cache = _cache_at(span, position, device, dtype)
    cache.begin_step(position, None, 1)
    slots = None if cache.recurrent is None else [cache.recurrent.static_slots(span.start, span.end)]
    step = StaticStep(span, [cache], span.start, span.end, dtype, kv_length=MAX_LENGTH, slots=slots)
    step.load([Segment(torch.ones(2, 1, HIDDEN, device=device, dtype=dtype), None, cache)])
    return step, cache


def _meta_dtype(name: str) -> torch.dtype:
    """On the meta device, as on a GPU, stacked experts' grouped product takes bfloat16 only (SparseMoe.stack)."""
    return torch.bfloat16 if name in MOE_STATIC or name in RECURRENT else torch.float32


@pytest.mark.parametrize("name", ["bloom", "qwen2", "llama dynamic rope", "deepseek_v3", "mixtral",
                                  "deepseek_v3 experts", "qwen3_next"])
@torch.inference_mode()
def test_a_static_step_reads_nothing_back_to_the_host(name):
    """On the meta device a tensor has no values: any read of one (.item(), .tolist(), bool(), int()) raises.
    The static step runs there; an eager step of unstacked experts, which sizes each expert's product on the
    host, does not."""
    fields, start, end = (STATIC | RECURRENT)[name]
    step, _cache = _static_step_on(_span(name, fields, start, end), "meta", dtype=_meta_dtype(name))
    step.run()
    eager = _span("mixtral", MOE_FAMILY["mixtral"], 0, 1).to("meta")
    cache = eager.new_cache(0, 1, 2, MAX_LENGTH, torch.float32, "meta")
    with pytest.raises((RuntimeError, NotImplementedError), match="(?i)meta"):  # bincount sizes on the host
        eager(torch.ones(2, 1, HIDDEN, device="meta"), cache.begin_step(0, None, 1), cache)


class _HostInputs(TorchDispatchMode):
    """The ops a computation on another device dispatches with a tensor of the host's among their inputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" for leaf in tree_leaves((args, kwargs))):
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(STATIC | RECURRENT))
@torch.inference_mode()
def test_after_its_warm_up_a_static_step_takes_nothing_from_the_host(name):
    """A graph holds device addresses: a tensor made on the host and copied over during the capture (rotary
    frequencies were, every pass) would be copied from freed memory at every replay, or refused. After the
    warm-up run that precedes a capture, the step on another device (meta here) touches no host tensor."""
    fields, start, end = (STATIC | RECURRENT)[name]
    step, _cache = _static_step_on(_span(name, fields, start, end), "meta", dtype=_meta_dtype(name))
    step.run()
    with _HostInputs() as host_inputs:
        step.run()
    assert host_inputs.calls == []


class _Kernels(TorchDispatchMode):
    """The ops a computation dispatches, with their outputs' shapes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in (output if isinstance(output, (tuple, list)) else [output])
                  if isinstance(t, torch.Tensor)]
        self.calls.append((str(func), shapes))
        return output


@pytest.mark.parametrize("name", ["bloom", "qwen2", "llama dynamic rope", "deepseek_v3", "mixtral",
                                  "deepseek_v3 experts", "qwen3_next"])
@torch.inference_mode()
def test_a_static_step_runs_the_same_kernels_on_the_same_shapes_at_every_position(name):
    """What a graph replays is what it captured: so a step at position 3 must dispatch what a step at 11 does
    (the eager step does not: its attention's shapes grow with the session)."""
    fields, start, end = (STATIC | RECURRENT)[name]
    span = _span(name, fields, start, end)
    traces = []
    for position in (3, 11):
        step, _cache = _static_step_on(span, "cpu", position)
        step.run()  # the warm-up before a capture (rotary frequencies are made once per device)
        with _Kernels() as kernels:
            step.run()
        traces.append(kernels.calls)
    assert traces[0] == traces[1]
    eager = []
    for position in (3, 11):
        cache = _cache_at(span, position)
        with _Kernels() as kernels:
            span(torch.ones(2, 1, HIDDEN), cache.begin_step(position, None, 1), cache)
        eager.append(kernels.calls)
    assert eager[0] != eager[1]


def test_only_a_gpu_servers_scheduler_runs_decode_passes_through_graphs(span, compute):
    """CPU serving keeps its eager passes, unchanged; a scheduler for a CUDA device gets StepGraphs (made without
    touching the GPU: the first capture does)."""
    from bloompeer.peer.server.scheduler import Scheduler

    assert Scheduler(span, compute, 64, "cpu", torch.float32).step_graphs is None
    assert isinstance(Scheduler(span, compute, 64, "cuda:1", torch.float32).step_graphs, StepGraphs)
