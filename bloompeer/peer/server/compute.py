"""The server's compute thread: every torch call on the serving path runs here, off the event loop.

One thread per device keeps a forward from stalling the network and keeps kernels from
competing for the same cores. On CPU it also picks torch's intra-op thread count per call. An
inference pass of a few rows (a decode step) runs on the count that such passes measurably run
fastest with (thread_choice.py): all cores while the others are free, one while something else keeps
them busy. Passes that batch several sessions' steps are measured apart from single requests' (their
linear layers run in oneDNN, blocks/batched_linear.py, and their attention once per session).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from .thread_choice import ThreadChoice

__all__ = ["ComputeWorker", "MEASURED_MAX_DECODE_ROWS", "SINGLE_THREAD_MAX_ROWS", "check_device"]

T = TypeVar("T")

# Inference passes of at most this many rows (batch x new tokens) run on a measured thread count;
# larger ones (long prompts) on every thread: on an idle 2-core machine two threads were faster from
# about 4 rows on (16 rows through 12 blocks of hidden 1024: 96 against 138 ms).
MEASURED_MAX_DECODE_ROWS = 64
# Other calls (whole-sequence forwards and backwards, for training) of at most this many rows run on
# one thread. Kept apart from decoding: the thread count changes the order of float sums, and a
# batch sent in parts must get the gradients it gets whole (2e-7 apart when it was not).
SINGLE_THREAD_MAX_ROWS = 1


def check_device(device: str) -> None:
    """Raise ValueError, saying what to do, unless this machine's torch can compute on `device`."""
    wanted = torch.device(device)
    if wanted.type != "cuda":
        return
    if not torch.backends.cuda.is_built():
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) was built without CUDA: install a "
                         f"CUDA build of torch (https://pytorch.org/get-started/locally/), or use --device cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"--device {device}: torch sees no CUDA device on this machine (is its driver loaded? "
                         f"nvidia-smi tells), or use --device cpu")
    if (wanted.index or 0) >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


class ComputeWorker:
    def __init__(self, device: str = "cpu", name: str = "bloompeer-compute", max_threads: int | None = None):
        """max_threads: the most torch threads a pass uses (default: torch's count for this process)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._cpu = torch.device(device).type == "cpu"
        self._max_threads = max_threads or torch.get_num_threads()
        self._threads = threading.local()  # .count: what each thread is set to (a per-thread OpenMP setting)
        self._serial_thread: int | None = None  # the thread make_caller_serial set to one torch thread
        self._single_choice = ThreadChoice(self._max_threads, self._set_threads)
        self._batched_choice = ThreadChoice(self._max_threads, self._set_threads)

    async def run(self, fn: Callable[..., T], *args, rows: int = 1 << 30, decode: bool = False,
                  batched: bool = False) -> T:
        """Run fn(*args) on the compute thread; `rows` (batch x tokens), whether it is an inference
        pass (`decode`) and whether that pass batches several requests (`batched`) size its threads."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._call, fn, args, rows, decode, batched)

    def _call(self, fn: Callable[..., T], args: tuple, rows: int, decode: bool, batched: bool) -> T:
        if not self._cpu:
            return fn(*args)
        if decode and rows <= MEASURED_MAX_DECODE_ROWS:
            choice = self._batched_choice if batched else self._single_choice
            return choice.run(rows, lambda: fn(*args))
        self._set_threads(1 if not decode and rows <= SINGLE_THREAD_MAX_ROWS else self._max_threads)
        return fn(*args)

    def runs_here(self, rows: int) -> bool:
        """Whether a lone inference pass of `rows` rows is to run on the calling thread (run_here): on
        the CPU, called from the serial thread (make_caller_serial), and passes of that size are to run
        on one thread now (ThreadChoice.choose), as they would on the compute thread."""
        return (self._cpu and self._serial_thread == threading.get_ident() and rows <= MEASURED_MAX_DECODE_ROWS
                and self._single_choice.choose(rows) == 1)

    def run_here(self, fn: Callable[..., T], *args, rows: int) -> T:
        """fn(*args) on the calling thread, timed for the one-thread choice of passes of `rows` rows;
        only where runs_here said so."""
        return self._single_choice.run(rows, lambda: fn(*args), threads=1)

    def make_caller_serial(self) -> None:
        """Run the calling thread's own torch ops (a server's event loop: reading and checking requests)
        on one thread, so that the compute thread's is the process's only OpenMP team. libgomp gives
        every thread that runs a parallel op a team of its own, and with a second team in the process
        the compute thread's two-thread decode passes took 59-66 ms instead of 42-55 (14 blocks of
        Qwen3-0.6B's shape, 2-core VM, idle). The compute thread sets its own count before every call."""
        self._set_threads(1)
        self._serial_thread = threading.get_ident()

    def _set_threads(self, threads: int) -> None:
        if threads != getattr(self._threads, "count", None):
            torch.set_num_threads(threads)
            self._threads.count = threads

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
