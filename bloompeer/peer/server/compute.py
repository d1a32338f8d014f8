"""The server's compute thread: every torch call on the serving path runs here, off the event loop.

One thread per device keeps a forward from stalling the network and keeps kernels from
competing for the same cores. On CPU it also picks torch's intra-op thread count per call: a
decode step of a few rows is bound by memory bandwidth, and splitting it over threads cost
more than it saved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["ComputeWorker", "SINGLE_THREAD_MAX_ROWS"]

T = TypeVar("T")

# Calls of at most this many rows (batch x new tokens) run on one thread. Measured on a 2-core
# CPU (scratch script, medians of 25 steps): one row took the same time on one thread as on two
# (hidden 1024, 12 blocks: 40.0 vs 40.4 ms), and much less when other processes competed for the
# cores (4 blocks of hidden 64: 1.1 vs 2.1 ms); 4 rows and more were faster on two threads
# (hidden 1024, 12 blocks, 16 rows: 138 vs 96 ms).
SINGLE_THREAD_MAX_ROWS = 1


class ComputeWorker:
    def __init__(self, device: str = "cpu", name: str = "bloompeer-compute"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._cpu = torch.device(device).type == "cpu"
        self._max_threads = torch.get_num_threads()
        self._threads = None  # what the compute thread is set to (a per-thread OpenMP setting)

    async def run(self, fn: Callable[..., T], *args, rows: int = 1 << 30) -> T:
        """Run fn(*args) on the compute thread; `rows` (batch x tokens) sizes its thread count."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args, rows)

    def _call(self, fn: Callable[..., T], args: tuple, rows: int) -> T:
        if self._cpu:
            threads = 1 if rows <= SINGLE_THREAD_MAX_ROWS else self._max_threads
            if threads != self._threads:
                torch.set_num_threads(threads)
                self._threads = threads
        return fn(*args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
