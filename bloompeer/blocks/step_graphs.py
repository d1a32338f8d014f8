"""A span's decode steps as CUDA graphs: captured once for the sessions that step together, then replayed.

On a GPU a decode step of a small model is launch-bound: 24 blocks of bloom-560m issue about 990
kernels (15.6 ms a step on an H200, whose weights take 0.14 ms to read). A CUDA graph replays the
whole step as one launch, but it replays exactly what it recorded: the same kernels on the same
addresses with the same shapes. So a graphed step is the span's own computation made static
(`StaticStep`): one new token per row, the new token's cache index a tensor (written with
index_copy_, `SessionCache.update_at`), attention over a fixed length of each session's
preallocated cache with a mask that hides what lies past the new token (so its shapes do not change
as the session grows), positions and masks computed from tensors, nothing read back to the host. In
float32 it equals the eager step within rounding (softmax and attention sum over the masked keys
too, as exact zeros, in other orders): tests/unit/test_step_graphs.py.

That fixed length is a bucket, not the whole cache: a session may preallocate 8192 tokens and hold
100, and a step attending over all of them would read 80 times the keys it needs (for bloom-560m,
0.8 GB a step where its weights are 1.1). A pass attends over the smallest power of two, at least
MIN_KV_BUCKET, that holds its longest session (each session's cut to its own max_length), so a graph
reads at most twice what the eager step reads, and a set of sessions is captured again only when
its longest one doubles.

A graph is keyed by the caches it steps, not by a bucketed session count: our sessions' caches are
allocations of their own (sized per session for the cache budget), and a graph holds their
addresses. Padding passes to buckets would need every session's cache in one shared arena and its
row indices as tensors; that changes the cache budget and the allocator, and is not done here. Sessions
that decode together keep coming back together (the scheduler gathers them), so one graph per set
serves a generation, captured on the set's second pass (a set seen once is not worth a capture),
at most MAX_GRAPHS held, the least recently used dropped first, and none replayed once a cache it
holds is gone. Whatever a static step cannot do runs eagerly, decided in one place (`eager_reason`):
a prompt or any pass of more than one new token, deep prompts, a forward without a cache, more
sessions or rows than a graph takes, a recurrent state that starts afresh or re-advances after a
rollback, and blocks whose family refuses a static step (`BlockSpan.static_step_refusal`: experts that
cannot be stacked, quantized ones, compute every expert in a static step and so need rows enough for
their number, `SparseMoe.static_refusal`). Dynamic rope grows its frequencies on the device from the
session's longest length (rope.py). A recurrent block (Gated DeltaNet) reads its state from one of two
slots and writes the other (recurrent_state.py), which the host picks: a graph replays the slots it was
captured with, so the slots a pass reads are part of its graph's key (`Slots`), the host marks what
they hold around the replay (`StaticStep.load`, `finish`), and a generation alternates between two
graphs. A mixture of experts takes static steps with its experts stacked (`SparseMoe.stack`, done as
StepGraphs is made): one grouped product per layer (torch._grouped_mm) whose group ends come from the
sorted choices on the device, where its eager pass runs one product per expert chosen, sized on the host.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

from .kv_cache import SessionCache
from .moe import GROUPED_EXPERTS, SparseMoe
from .recurrent_state import FixedSlots
from .span import BlockSpan, Segment

__all__ = ["GraphKeys", "StaticStep", "StaticStepCache", "StepGraphs", "capture_cuda_graph", "eager_reason",
           "kv_bucket", "stack_experts"]

logger = logging.getLogger(__name__)

MAX_GRAPH_SESSIONS = 8  # sessions in one graphed pass; a fuller pass runs eagerly
MAX_GRAPH_ROWS = 64  # rows (every session's batch, one token each) in one graphed pass
MAX_GRAPHS = 16  # graphs held at once, each with its own memory pool of the step's activations
MIN_KV_BUCKET = 64  # the shortest cache length a graphed step attends over
CAPTURE_ON_PASS = 2  # a set of sessions is captured on its second pass, replayed from its third

Replay = Callable[[], list[torch.Tensor]]  # runs a captured step again; its outputs, one per session


def eager_reason(span: BlockSpan, segments: Sequence[Segment], start: int, end: int,
                 max_sessions: int = MAX_GRAPH_SESSIONS, max_rows: int = MAX_GRAPH_ROWS,
                 refusal: Callable[[int, int, int], str | None] | None = None) -> str | None:
    """Why this pass of blocks [start, end) must run eagerly, or None if a graph can run it. refusal: the
    span's static_step_refusal, given the pass's rows (StepGraphs passes it memoized: it walks a sparse
    block's modules)."""
    if len(segments) > max_sessions:
        return f"{len(segments)} sessions in one pass: graphs take up to {max_sessions}"
    for segment in segments:
        if segment.cache is None:
            return "a forward without a cache"
        if segment.hidden.shape[1] != 1:
            return f"{segment.hidden.shape[1]} new tokens (a prompt, or a speculative step): graphs take one"
        if segment.prompts is not None:
            return "deep prompts"
        if segment.cache.recurrent is not None and segment.cache.recurrent.static_slots(start, end) is None:
            return "a recurrent state that starts afresh or re-advances after a rollback"
    rows = sum(segment.hidden.shape[0] for segment in segments)
    if rows > max_rows:
        return f"{rows} rows in one pass: graphs take up to {max_rows}"
    return (refusal or span.static_step_refusal)(start, end, rows)


def stack_experts(span: BlockSpan) -> None:
    """Stack the experts of every sparse MLP of the span (SparseMoe.stack), so that its blocks take static steps."""
    for module in span.modules():
        if isinstance(module, SparseMoe):
            module.stack()


def kv_bucket(lengths: Sequence[int], min_bucket: int = MIN_KV_BUCKET) -> int:
    """The cache length a pass of sessions `lengths` long (their new token included) attends over: the
    smallest power of two >= the longest and >= min_bucket (each session's then cut to its max_length)."""
    return max(min_bucket, 1 << (max(lengths) - 1).bit_length())


Slots = tuple[int, ...] | None  # a session's recurrent blocks' slots a static step reads (None: it has none)


class StaticStepCache:
    """A session's cache as a static step writes to it: at a cache index held in a tensor, read over a fixed
    length (the pass's bucket); its recurrent blocks from fixed slots (recurrent_state.FixedSlots)."""

    def __init__(self, cache: SessionCache, index: torch.Tensor, length: int, recurrent: FixedSlots | None):
        self.cache, self.index, self.length, self.recurrent = cache, index, length, recurrent
        self.rope_length = cache.rope_length

    def update(self, layer_idx: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.cache.update_at(layer_idx, self.index, self.length, *new)


class StaticStep:
    """The decode step of a set of sessions through blocks [start, end) with static shapes and buffers, each
    session attending over its first `kv_length` cache entries (or all of its max_length, if fewer) and its
    recurrent blocks reading the slots `slots` says: `load` puts a pass's inputs into the buffers (hidden
    states, and each new token's cache index, below that length) and `run` computes the step from them alone,
    reading nothing back to the host, so that a graph captured from `run` replays any later step of these
    sessions within that length from those slots; `finish` then marks on the host what the step wrote. It holds
    the caches weakly: a graph must not keep a closed session's memory."""

    def __init__(self, span: BlockSpan, caches: Sequence[SessionCache], start: int, end: int, dtype: torch.dtype,
                 kv_length: int, slots: Sequence[Slots] | None = None):
        self.span, self.start, self.end = span, start, end
        self._caches = [weakref.ref(cache) for cache in caches]
        self._slots = list(slots or [None] * len(caches))
        self.device = device = caches[0].padding_mask.device
        self.hidden = [torch.zeros(cache.batch, 1, span.config.hidden_size, dtype=dtype, device=device)
                       for cache in caches]  # [batch, 1, hidden] each
        self.index = [torch.zeros(1, dtype=torch.long, device=device) for _ in caches]  # the new token's
        self._key_index = [torch.arange(min(kv_length, cache.max_length), device=device) for cache in caches]

    def holds(self, caches: Sequence[SessionCache]) -> bool:
        """Whether this step is of these very caches (a cache gone and another at its id is not)."""
        return len(caches) == len(self._caches) and all(ref() is cache for ref, cache in zip(self._caches, caches))

    def load(self, segments: Sequence[Segment]) -> None:
        """A pass's inputs into the buffers; its caches have begun the step (SessionCache.begin_step)."""
        for hidden, index, segment, fixed in zip(self.hidden, self.index, segments, self._fixed(), strict=True):
            hidden.copy_(segment.hidden)
            index.fill_(segment.cache.length - 1)
            if fixed is not None:
                fixed.begin()

    def finish(self) -> None:
        """After the step ran: its recurrent blocks' written slots hold the new position."""
        for fixed in self._fixed():
            if fixed is not None:
                fixed.end()

    def run(self) -> list[torch.Tensor]:
        """The step from the buffers: each session's output [batch, 1, hidden]."""
        segments = []
        for hidden, index, key_index, ref, fixed in zip(self.hidden, self.index, self._key_index, self._caches,
                                                        self._fixed()):
            cache = ref()
            length = key_index.shape[0]
            visible = cache.padding_mask[:, :length] & (key_index <= index)  # [batch, length]: none past the new
            segments.append(Segment(hidden, visible, StaticStepCache(cache, index, length, fixed), query_index=index))
        grouped = GROUPED_EXPERTS.set(True)  # stacked experts: one grouped product a layer, no host read
        try:
            return self.span.forward_segments(segments, self.start, self.end)
        finally:
            GROUPED_EXPERTS.reset(grouped)

    def _fixed(self) -> list[FixedSlots | None]:
        """Each session's recurrent state as the step computes it (made anew, to hold no cache strongly)."""
        caches = [ref() for ref in self._caches]
        if any(cache is None for cache in caches):
            raise RuntimeError("a static step ran after one of its sessions' caches was freed")
        return [None if slots is None else cache.recurrent.fixed_slots(self.start, self.end, slots)
                for cache, slots in zip(caches, self._slots)]


def capture_cuda_graph(step: StaticStep) -> Replay:
    """Capture `step.run` as a CUDA graph (after a warm-up run on a side stream, as CUDA graphs need: lazily
    made handles and workspaces are made outside the capture); its replay. The warm-up computes the very step
    loaded (it writes the same cache entries the replay writes again)."""
    with torch.cuda.device(step.device):  # the step's GPU, whichever is current (a server on cuda:1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = step.run()

    def replay() -> list[torch.Tensor]:
        with torch.cuda.device(step.device):
            graph.replay()
        return outputs

    return replay


class GraphKeys:
    """Which sets of sessions have graphs (least recently used first) and which have been seen without one:
    `plan(key)` says what a pass of that set does, "replay", "capture" or "eager"."""

    def __init__(self, max_graphs: int = MAX_GRAPHS, capture_on_pass: int = CAPTURE_ON_PASS):
        self.max_graphs, self.capture_on_pass = max_graphs, capture_on_pass
        self.graphs: OrderedDict[Hashable, tuple[StaticStep, Replay]] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()  # passes of sets without a graph, bounded too

    def plan(self, key: Hashable) -> str:
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return "replay"
        self._seen[key] = self._seen.pop(key, 0) + 1
        while len(self._seen) > 4 * self.max_graphs:
            self._seen.popitem(last=False)
        return "capture" if self._seen[key] >= self.capture_on_pass else "eager"

    def add(self, key: Hashable, step: StaticStep, replay: Replay) -> None:
        self._seen.pop(key, None)
        self.graphs[key] = (step, replay)
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)

    def drop(self, key: Hashable) -> None:
        self.graphs.pop(key, None)


class StepGraphs:
    """A span's decode passes through graphs where they can be (module docstring), eagerly otherwise; what
    the server's scheduler calls instead of `span.forward_segments` for inference passes on a GPU.
    capture: StaticStep -> its replay (capture_cuda_graph; a test on the CPU replays by running the step)."""

    def __init__(self, span: BlockSpan, capture: Callable[[StaticStep], Replay] = capture_cuda_graph,
                 keys: GraphKeys | None = None, min_kv_bucket: int = MIN_KV_BUCKET):
        self.span, self.capture, self.min_kv_bucket = span, capture, min_kv_bucket
        self.keys = keys or GraphKeys()
        self.broken: str | None = None  # why capturing failed once (then every pass runs eagerly)
        self.counts = {"replay": 0, "capture": 0, "eager": 0}
        stack_experts(span)
        self._refusals: dict[tuple[int, int, int], str | None] = {}  # (start, end, rows) -> why eagerly

    def _refusal(self, start: int, end: int, rows: int) -> str | None:
        if (start, end, rows) not in self._refusals:
            self._refusals[start, end, rows] = self.span.static_step_refusal(start, end, rows)
        return self._refusals[start, end, rows]

    def forward(self, segments: Sequence[Segment], start: int, end: int) -> list[torch.Tensor]:
        """span.forward_segments(segments, start, end), through a graph where one serves."""
        if (self.broken or eager_reason(self.span, segments, start, end, refusal=self._refusal)) is not None:
            self.counts["eager"] += 1
            return self.span.forward_segments(segments, start, end)
        order = sorted(range(len(segments)), key=lambda i: id(segments[i].cache))  # one graph whatever the order
        ordered = [segments[i] for i in order]
        caches = [segment.cache for segment in ordered]
        kv_length = kv_bucket([cache.length for cache in caches], self.min_kv_bucket)
        slots = tuple(None if cache.recurrent is None else cache.recurrent.static_slots(start, end) for cache in caches)
        key = (start, end, kv_length, slots, *(id(cache) for cache in caches))
        plan = self.keys.plan(key)
        if plan == "replay" and not self.keys.graphs[key][0].holds(caches):
            self.keys.drop(key)  # a cache of that set is gone, and this one took its id
            plan = self.keys.plan(key)
        self.counts[plan] += 1
        graph = None
        if plan == "capture":
            graph = self._capture(key, ordered, kv_length, slots)
        elif plan == "replay":
            graph = self.keys.graphs[key]
            graph[0].load(ordered)
        if graph is None:
            return self.span.forward_segments(segments, start, end)
        step, replay = graph
        outputs = replay()
        step.finish()
        in_order = [None] * len(segments)
        for position, index in enumerate(order):
            in_order[index] = outputs[position].clone()  # the graph's buffer is written again by its next replay
        return in_order

    def _capture(self, key: tuple, segments: list[Segment], kv_length: int,
                 slots: tuple[Slots, ...]) -> tuple[StaticStep, Replay] | None:
        """Capture the step of these segments' sessions (their inputs loaded); None if it cannot be, and then
        every later pass runs eagerly (an op that cannot be captured would fail every capture)."""
        step = StaticStep(self.span, [segment.cache for segment in segments], *key[:2], segments[0].hidden.dtype,
                          kv_length, slots)
        step.load(segments)
        try:
            replay = self.capture(step)
        except Exception as exc:
            self.broken = f"capturing a step failed ({type(exc).__name__}: {exc})"
            logger.warning("Decode steps run without CUDA graphs: %s", self.broken, exc_info=True)
            return None
        logger.debug("Captured the decode step of %d sessions through blocks %d:%d over %d cache entries",
                     len(segments), *key[:3])
        self.keys.add(key, step, replay)
        return step, replay
