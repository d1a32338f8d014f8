"""The server's compute thread: every torch call on the serving path runs here, off the event loop.

One thread per device keeps a forward from stalling the network and keeps kernels from
competing for the same cores. On CPU it also picks torch's intra-op thread count per call: a
decode step of a few rows is bound by memory bandwidth, and splitting it over threads cost
more than it saved. The linear layers of a decode pass that batches several sessions run in
oneDNN (blocks/batched_linear.py), on as many threads as such passes measurably run fastest with
(batched_threads.py): there the barrier is once per layer, and whether it pays depends on the other core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from ...blocks import set_batched_threads
from ...blocks.batched_linear import MAX_ROWS as BATCHED_LINEAR_MAX_ROWS
from .batched_threads import BatchedThreadChoice

__all__ = ["ComputeWorker", "SINGLE_THREAD_MAX_DECODE_ROWS", "SINGLE_THREAD_MAX_ROWS"]

T = TypeVar("T")

# Inference passes of at most this many rows (batch x new tokens) run on one thread: every decode
# pass, also one batching many sessions' steps. Splitting a pass over torch's threads means a barrier at every
# op, so both threads must get a core a hundred times per pass; on a 2-core machine where the
# server shares the cores with its p2p daemon, its clients or anything else, that waiting cost far
# more than the second core gave. Measured (benchmarks/throughput.py and a scratch script, 12 blocks
# of hidden 1024, 2 cores busy with other work): 8 rows 190 vs 1068 ms on one vs two threads,
# 32 rows 427 vs 3304 ms; 8 light sessions on a server of 4 blocks of hidden 64: 446 vs 23 steps/s.
# On an idle machine two threads were faster from about 4 rows on (16 rows: 138 vs 96 ms), so
# large passes (long prompts) still use every thread.
SINGLE_THREAD_MAX_DECODE_ROWS = 64
# Other calls (whole-sequence forwards and backwards, for training) of at most this many rows run on
# one thread. Kept apart from decoding: the thread count changes the order of float sums, and a
# batch sent in parts must get the gradients it gets whole (2e-7 apart when it was not).
SINGLE_THREAD_MAX_ROWS = 1


class ComputeWorker:
    def __init__(self, device: str = "cpu", name: str = "bloompeer-compute"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._cpu = torch.device(device).type == "cpu"
        self._max_threads = torch.get_num_threads()
        self._threads = None  # what the compute thread is set to (a per-thread OpenMP setting)
        self._batched_threads = BatchedThreadChoice(self._max_threads, set_batched_threads)

    async def run(self, fn: Callable[..., T], *args, rows: int = 1 << 30, decode: bool = False,
                  batched: bool = False) -> T:
        """Run fn(*args) on the compute thread; `rows` (batch x tokens) and whether it is an
        inference pass (`decode`) size its thread count; a decode pass of several requests
        (`batched`) has its linear layers in oneDNN, with the thread count that batched_threads.py chooses."""
        single_max = SINGLE_THREAD_MAX_DECODE_ROWS if decode else SINGLE_THREAD_MAX_ROWS
        threads = 1 if rows <= single_max else self._max_threads
        measured = self._cpu and batched and decode and rows <= BATCHED_LINEAR_MAX_ROWS
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._call, fn, args, threads, rows if measured else None)

    def _call(self, fn: Callable[..., T], args: tuple, threads: int, batched_rows: int | None) -> T:
        if self._cpu:
            if threads != self._threads:
                torch.set_num_threads(threads)
                self._threads = threads
        if batched_rows is None:
            return fn(*args)
        return self._batched_threads.run(batched_rows, lambda: fn(*args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
