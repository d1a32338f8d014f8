"""The server's work queue: what the compute thread runs next, and which requests run together.

Inference steps of different sessions that are waiting at the same time run as one pass
through the blocks (a batch of 8 one-token steps costs barely more than one: the weights are
read once). Inference goes before full forwards, which go before backwards. A batch never holds
more than `max_batch_tokens` rows; a prefill larger than that runs as consecutive chunks.
If a batch fails, its requests are retried one by one, so an error reaches only the request
that caused it.

Sessions that step together keep coming back together, but not at the same instant: each answer
makes a round trip through its client first. Started on the first step to come back, a pass would
run alone and the others would queue behind it, and the sessions would stay split into groups
that take turns. So before a pass, the scheduler waits briefly (a share of the previous pass's
time, ending as soon as they are all in) for the sessions of the previous pass that have not sent
their next step yet.

A server may also be told to wait longer for fuller passes (`serve --batch-wait`, as TorchServe's
maxBatchDelay): a pass of inference steps then waits up to that long for the pass to fill
(`--max-batch-sessions` steps, or `--max-batch-tokens` rows), whichever sessions the steps are of.
Fewer, fuller passes, at the cost of latency; and a pass that holds its sessions' steps until they
are all in, whatever the machine's speed (tests/swarm/test_llama_family.py relies on it).

A lone session's short step runs at once on the event loop's own thread (`_runs_now`): nothing
else waits or runs, its session passed alone last time, that pass took at most RUN_NOW_MAX_PASS_S,
and the compute thread would run it on one thread too. Its hand-offs to the compute thread and back
cost more than the rest of the server's work on the step (benchmarks/step_anatomy.py, demo model:
queue 0.26 and resume 0.30 ms a server of a 10 ms step), while a pass that short holds the loop's
other work (other sessions' frames, DHT answers) no longer than a busy turn of the loop would.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from typing import Any

import torch

from ...blocks import BlockSpan, Segment, SessionCache
from ...blocks.recurrent_state import RewindError
from ...blocks.step_graphs import StepGraphs
from ...p2p import BackwardRequest, ErrorCode, ProtocolError, Step
from .compute import ComputeWorker
from .metrics import ServerMetrics
from .scheduled_work import Pass, Priority, Work, prompts_within
from .step_clock import StepClock

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)

# Before a pass, wait for the rest of the previous pass's sessions up to this share of its duration.
# Measured (benchmarks/throughput.py, 8 light sessions, 12 blocks of hidden 1024): without the wait
# the sessions ran as two alternating groups (4.0 requests per pass).
GATHER_SHARE = 0.25
# The longest previous pass after which a lone session's step may run on the event loop's thread.
RUN_NOW_MAX_PASS_S = 0.005


class Scheduler:
    """The only way work reaches the compute thread.

    Handlers await `step`, `forward` or `backward`; the scheduler decides what runs next and with
    what. One queue for every request lets it batch steps of different sessions (what turns many
    light clients into throughput), put interactive decoding ahead of training traffic, and split
    passes by `max_batch_tokens` so that no request can make the others wait for a huge pass.
    """

    def __init__(self, span: BlockSpan, compute: ComputeWorker, max_batch_tokens: int, device: str,
                 dtype: torch.dtype, max_batch_sessions: int | None = None, metrics: ServerMetrics | None = None,
                 batch_wait_s: float = 0.0):
        """max_batch_sessions: at most this many requests share a pass (None: as many as fit in
        max_batch_tokens; 1 turns cross-session batching off, for comparison). batch_wait_s: how long
        a pass of inference steps may wait to fill (0: only the brief wait for the previous pass's sessions)."""
        self.span, self.compute, self.max_batch_tokens = span, compute, max_batch_tokens
        if max_batch_sessions is not None and max_batch_sessions < 1:
            raise ValueError(f"max_batch_sessions must be at least 1, got {max_batch_sessions}")
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must not be negative, got {batch_wait_s}")
        self.max_batch_sessions, self.batch_wait_s = max_batch_sessions, batch_wait_s
        self.metrics = metrics or ServerMetrics()
        self.device, self.dtype = device, dtype
        # on a GPU, decode passes replay CUDA graphs where they can (blocks/step_graphs.py); the CPU runs eagerly
        self.step_graphs = StepGraphs(span) if torch.device(device).type == "cuda" else None
        self._queue: list[Work] = []
        self._ready = asyncio.Event()
        self._arrived = asyncio.Event()  # set by every submission: what a gathering wait waits on
        self._last_pass: dict[tuple, Pass] = {}  # an inference group's last pass
        self._order = itertools.count()
        self._stopped = False
        self._idle = asyncio.Event()  # set while no pass runs
        self._idle.set()
        self.batches_run = 0  # for tests and logs: how many passes ran, and with how many requests
        self.requests_run = 0

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the compute thread."""
        return len(self._queue)

    async def step(self, session_id: str, cache: SessionCache, step: Step, clock: StepClock | None = None
                   ) -> torch.Tensor:
        """One inference step of a session (`cache` is its cache), in chunks of at most max_batch_tokens rows;
        each chunk's wait and pass are added to `clock`."""
        batch, num_new = step.hidden.shape[:2]
        chunk = self.max_batch_tokens // batch
        if chunk < 1:
            raise ProtocolError(f"a batch of {batch} rows exceeds this server's {self.max_batch_tokens} rows "
                                f"per pass (bloompeer serve --max-batch-tokens)", ErrorCode.TOO_LARGE)
        outputs = []
        for begin in range(0, num_new, chunk):
            end = min(num_new, begin + chunk)
            part = Step(step.position + begin, step.hidden[:, begin:end],
                        None if step.padding_mask is None else step.padding_mask[:, begin:end],
                        step.hypo_ids if begin == 0 else None, prompts=prompts_within(step.prompts, begin, end))
            work = self._inference_work(session_id, cache, part)
            outputs.append(await self._submit(work))
            if clock is not None:
                clock.add_pass(work.submitted, work.started, work.ended)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _inference_work(self, session_id: str, cache: SessionCache, step: Step) -> Work:
        length_before = cache.length
        num_new = step.hidden.shape[1]
        reordered = step.hypo_ids is None

        def segment() -> Segment:
            nonlocal reordered
            if not reordered:  # once: a batch that failed calls segment() again for each of its requests
                cache.reorder(step.hypo_ids.to(self.device))
                reordered = True
            hidden, mask = self._on_device(step.hidden), self._on_device(step.padding_mask)
            try:
                padding = cache.begin_step(step.position, mask, num_new)
            except RewindError as exc:  # a recurrent state goes back only so far: the client replays elsewhere
                raise ProtocolError(str(exc), ErrorCode.UNSUPPORTED) from None
            return Segment(hidden, padding, cache, self._on_device(step.prompts))

        def rollback() -> None:
            cache.restore_length(length_before)

        return Work(Priority.INFERENCE, next(self._order), ("inference", cache.start, cache.end),
                    step.hidden.shape[0] * num_new, segment=segment, rollback=rollback,
                    finish=lambda output: output.to("cpu", step.hidden.dtype), session=session_id)

    def _check_rows(self, hidden: torch.Tensor) -> int:
        rows = hidden.shape[0] * hidden.shape[1]
        if rows > self.max_batch_tokens:
            raise ProtocolError(f"{rows} rows (batch x length) exceed this server's {self.max_batch_tokens} rows "
                                f"per pass (bloompeer serve --max-batch-tokens); send fewer sequences per request",
                                ErrorCode.TOO_LARGE)
        return rows

    def _on_device(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        return tensor.to(self.device, self.dtype if tensor.is_floating_point() else tensor.dtype)

    async def forward(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None, start: int, end: int,
                      prompts: torch.Tensor | None = None) -> torch.Tensor:
        """A full forward (no cache kept) of blocks [start, end)."""
        rows = self._check_rows(hidden)

        def run() -> torch.Tensor:
            output = self.span(self._on_device(hidden), self._on_device(padding_mask), None, start, end,
                               self._on_device(prompts))
            return output.to("cpu", hidden.dtype)

        return await self._submit(Work(Priority.FORWARD, next(self._order), ("forward",), rows, run=run))

    async def backward(self, request: BackwardRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients with respect to the span's input and deep prompts: the forward is recomputed
        with autograd (the weights are frozen, so no gradient of theirs is even computed)."""
        rows = self._check_rows(request.hidden)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden = self._on_device(request.hidden).requires_grad_()
            prompts = self._on_device(request.prompts)
            inputs = [hidden] if prompts is None else [hidden, prompts.requires_grad_()]
            with torch.enable_grad():
                output = self.span(hidden, self._on_device(request.padding_mask), None, request.start, request.end,
                                   prompts)
                grads = torch.autograd.grad(output, inputs, self._on_device(request.grad_output))
            grad_prompts = None if prompts is None else grads[1].to("cpu", request.prompts.dtype)
            return grads[0].to("cpu", request.hidden.dtype), grad_prompts

        return await self._submit(Work(Priority.BACKWARD, next(self._order), ("backward",), rows, run=run))

    async def _submit(self, work: Work) -> torch.Tensor:
        if self._stopped:
            raise _moved_away()
        if self._runs_now(work):
            return self._run_now(work)
        work.future = asyncio.get_running_loop().create_future()
        work.submitted = time.perf_counter()
        heapq.heappush(self._queue, work)
        self._ready.set()
        self._arrived.set()
        return await work.future

    def _runs_now(self, work: Work) -> bool:
        """Whether `work` is a lone session's short step to run on this thread now (the module's docstring
        says why). Asked only while no pass runs, so the compute thread's choice is this thread's to consult."""
        if work.segment is None or self._queue or not self._idle.is_set() or self.batch_wait_s:
            return False
        previous = self._last_pass.get(work.group)
        return (previous is not None and previous.sessions == {work.session} and work.rows <= previous.rows
                and previous.seconds <= RUN_NOW_MAX_PASS_S and self.compute.runs_here(work.rows))

    def _run_now(self, work: Work) -> torch.Tensor:
        work.submitted = started = time.perf_counter()
        self._idle.clear()
        try:
            (output, error), = self.compute.run_here(self._execute, [work], rows=work.rows)
        finally:
            self._idle.set()
        self._account([work], work.rows, started)
        if error is not None:
            raise error
        return output

    def _account(self, batch: list[Work], rows: int, started: float) -> None:
        """Note a pass that ran `batch` from `started` (a time.perf_counter()) until now."""
        if batch[0].segment is not None:
            self._last_pass[batch[0].group] = Pass(frozenset(work.session for work in batch),
                                                    time.perf_counter() - started, rows)
        self.batches_run += 1
        self.requests_run += len(batch)
        self.metrics.count_pass(batch[0].priority.name.lower(), len(batch), rows)

    async def _gather(self) -> None:
        """Wait (briefly) for the sessions of the previous pass of the first work's group that have
        not sent their next step yet, while the pass they would join has room for them; with
        batch_wait_s, wait up to that long for the pass to fill, whoever's steps fill it."""
        first = self._queue[0]
        if first.segment is None or self.max_batch_sessions == 1:
            return
        previous = self._last_pass.get(first.group)
        if previous is None and not self.batch_wait_s:
            return
        sessions, duration_s = (previous.sessions, previous.seconds) if previous else (frozenset(), 0.0)
        deadline = time.perf_counter() + max(GATHER_SHARE * duration_s, self.batch_wait_s)
        while not self._stopped:
            queued = [work for work in self._queue if work.group == first.group]
            full = (sum(work.rows for work in queued) >= self.max_batch_tokens
                    or len(queued) >= (self.max_batch_sessions or float("inf")))
            if full or (not self.batch_wait_s and sessions <= {work.session for work in queued}):
                return
            left_s = deadline - time.perf_counter()
            if left_s <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left_s)
            except asyncio.TimeoutError:
                return

    def _next_batch(self) -> list[Work]:
        """The first waiting work, plus any work of its group that fits (in queue order), one step per
        session: two steps of one cache in a pass would write to it at once."""
        first = heapq.heappop(self._queue)
        batch, rows, skipped, sessions = [first], first.rows, [], {first.session}
        while self._queue and first.segment is not None and len(batch) != self.max_batch_sessions:
            work = heapq.heappop(self._queue)
            if (work.segment is not None and work.group == first.group and work.session not in sessions
                    and rows + work.rows <= self.max_batch_tokens):
                batch.append(work)
                rows += work.rows
                sessions.add(work.session)
            else:
                skipped.append(work)
        for work in skipped:
            heapq.heappush(self._queue, work)
        return batch

    async def stop(self) -> None:
        """Refuse the waiting work and anything submitted from now on (the span is going away), and
        return once the pass running now, if any, has answered its requests; run() then ends."""
        self._stopped = True
        for work in self._queue:
            if not work.future.done():
                work.future.set_exception(_moved_away())
        self._queue.clear()
        self._ready.set()
        self._arrived.set()  # a pass being gathered is not waited for any longer
        await self._idle.wait()

    async def run(self) -> None:
        """Feed the compute thread until stopped (run as a task)."""
        while not self._stopped:
            await self._ready.wait()
            if not self._queue:
                self._ready.clear()
                continue
            await self._gather()
            if not self._queue:  # stopped while gathering
                continue
            batch = [work for work in self._next_batch() if not work.future.cancelled()]
            if not batch:
                continue
            rows = sum(work.rows for work in batch)
            started = time.perf_counter()
            self._idle.clear()
            try:
                results = await self.compute.run(self._execute, batch, rows=rows,
                                                decode=batch[0].segment is not None, batched=len(batch) > 1)
            finally:
                self._idle.set()
            self._account(batch, rows, started)
            for work, (output, error) in zip(batch, results):
                if work.future.done():
                    continue
                if error is not None:
                    work.future.set_exception(error)
                else:
                    work.future.set_result(output)

    def _execute(self, batch: list[Work]) -> list[tuple[Any, BaseException | None]]:
        """On the compute thread: one pass for the batch (timed on each work), or each work alone if it fails."""
        started = time.perf_counter()
        results = self._execute_pass(batch)
        ended = time.perf_counter()
        for work in batch:
            work.started, work.ended = started, ended
        return results

    def _execute_pass(self, batch: list[Work]) -> list[tuple[Any, BaseException | None]]:
        with torch.inference_mode(batch[0].priority is not Priority.BACKWARD):
            if len(batch) > 1:
                try:
                    outputs = self._inference_pass([work.segment() for work in batch], batch[0].group)
                    return [(work.finish(output), None) for work, output in zip(batch, outputs)]
                except Exception:
                    logger.warning("A batch of %d requests failed; running them one by one", len(batch),
                                   exc_info=True)
                    for work in batch:
                        work.rollback()
            return [self._execute_alone(work) for work in batch]

    def _inference_pass(self, segments: list[Segment], group: tuple) -> list[torch.Tensor]:
        """One pass of inference steps through the group's blocks, through CUDA graphs where they serve."""
        if self.step_graphs is not None:
            return self.step_graphs.forward(segments, *group[1:])
        return self.span.forward_segments(segments, *group[1:])

    def _execute_alone(self, work: Work) -> tuple[Any, BaseException | None]:
        try:
            if work.segment is not None:
                output = self._inference_pass([work.segment()], work.group)[0]
            else:
                output = work.run()
            return work.finish(output), None
        except Exception as exc:
            work.rollback()
            if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc):
                exc = ProtocolError(f"the server ran out of memory for this request: {exc}", ErrorCode.BUSY)
            return None, exc


def _moved_away() -> ProtocolError:
    return ProtocolError("this server stopped serving these blocks (it is moving to others); use another server",
                         ErrorCode.NOT_SERVING)
