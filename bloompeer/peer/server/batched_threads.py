"""How many threads the linear layers of a batched decode pass get: the count that recent passes of
that size ran faster with, trying more threads only while the other cores look free.

Why measured, not set: oneDNN splits each of a batched pass's linear layers (blocks/batched_linear.py)
across its threads and waits for the slowest. With the second core free that is much faster; with
something else keeping it busy, every layer waits for a descheduled thread. Measured when these
layers ran in OpenBLAS, which splits them alike; 8 rows through 12 blocks of hidden 1024 on a 2-core
VM: 109 to 128 ms on two threads, 162 to 181 ms on one; with a busy loop on the other core, passes on
two threads took 0.9 to 2.8 s inside a server whose clients shared the remaining core.

So each size of pass (rows, by powers of two) keeps a moving average of its time per thread count and
uses the faster. Now and then it tries the other once, to notice that the machine changed: after
RETRY_EVERY passes at first, twice as long after each try that lost (up to MAX_RETRY_EVERY). A try's
time replaces that count's old average (it is news, not noise), so one winning try is enough to
switch. A losing try of more threads can cost ten passes' time, so more threads are tried only when,
during the last pass on one thread long enough to tell, the other cores were at least half idle
(/proc/stat).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["BatchedThreadChoice"]

T = TypeVar("T")

RETRY_EVERY = 16
MAX_RETRY_EVERY = 1024
SMOOTHING = 0.3  # weight of the newest pass in the moving average: one slow pass is enough to switch
FREE_IDLE_SHARE = 0.5  # of the other cores' time, idle during a one-thread pass
MIN_TICKS = 5  # a shorter pass (in the other cores' clock ticks, 10 ms each) leaves the last judgement as it was


class _Size:
    """What is known about passes of one size."""

    def __init__(self):
        self.seconds: dict[int, float] = {}  # threads -> moving average of a pass's time
        self.last = 0  # the thread count of the last pass
        self.since_try = 0  # passes since the last try of the slower count
        self.retry_every = RETRY_EVERY
        self.trying: int | None = None  # the count being tried in this pass, if it is a try


class BatchedThreadChoice:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None] = lambda threads: None):
        self.options = (1, max_threads) if max_threads > 1 else (1,)
        self._set_threads = set_threads
        self._sizes: dict[int, _Size] = {}
        self.others_free = True  # whether the other cores looked free during the last one-thread pass
        self._others_ticks_per_s = os.sysconf("SC_CLK_TCK") * ((os.cpu_count() or 1) - 1)

    def run(self, rows: int, fn: Callable[[], T]) -> T:
        """fn() on the thread count chosen for a pass of `rows`, timed and recorded; a pass on one
        thread also says whether the other cores are free."""
        threads = self.choose(rows)
        self._set_threads(threads)
        idle_before = _idle_ticks() if threads == 1 else None
        started = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - started
        self.record(rows, threads, seconds)
        if idle_before is not None:
            self._judge_others(idle_before, seconds)
        return result

    def _judge_others(self, idle_before: int, seconds: float) -> None:
        possible = seconds * self._others_ticks_per_s  # the other cores' ticks during the pass
        idle_after = _idle_ticks()
        if idle_after is not None and possible >= MIN_TICKS:
            self.others_free = (idle_after - idle_before) >= FREE_IDLE_SHARE * possible

    def choose(self, rows: int) -> int:
        size = self._sizes.setdefault(rows.bit_length(), _Size())
        untried = [threads for threads in self.options if threads not in size.seconds]
        if untried and (untried[0] == 1 or self.others_free):
            size.since_try = 0
            return untried[0]
        fastest = min(size.seconds, key=size.seconds.__getitem__)
        size.since_try += 1
        slower = next((threads for threads in self.options if threads != fastest), None)
        try_due = slower is not None and size.since_try >= size.retry_every
        if try_due and (slower == 1 or self.others_free):
            size.since_try, size.trying = 0, slower
            return slower
        return fastest

    def record(self, rows: int, threads: int, seconds: float) -> None:
        size = self._sizes.setdefault(rows.bit_length(), _Size())
        previous = size.seconds.get(threads)
        if previous is None or size.last != threads:
            size.seconds[threads] = seconds
        else:
            size.seconds[threads] = previous + SMOOTHING * (seconds - previous)
        size.last = threads
        if size.trying == threads:
            won = min(size.seconds, key=size.seconds.__getitem__) == threads
            size.retry_every = RETRY_EVERY if won else min(2 * size.retry_every, MAX_RETRY_EVERY)
            size.trying = None


def _idle_ticks() -> int | None:
    """The machine's idle and iowait time so far, in clock ticks (None where there is no /proc/stat)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        return int(fields[4]) + int(fields[5])
    except (OSError, IndexError, ValueError):
        return None
