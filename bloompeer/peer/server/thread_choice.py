"""How many threads a small inference pass runs on: the count that recent passes of that size ran
faster with, trying more threads only while the other cores look free.

Why measured, not set: splitting a pass over threads makes each op wait for the slowest thread.
With the other core free that is much faster: 14 blocks of Qwen3-0.6B's shape, one decode step,
95 ms on one thread and 56 ms on two (2-core VM, idle). With something else keeping the other core
busy, every op waits for a descheduled thread: 8 rows through 12 blocks of hidden 1024 took 0.9 to
2.8 s on two threads against 0.16 s on one, in a server whose clients shared the remaining core.
Only a pass's own time tells which case it is in.

So each size of pass (rows, by powers of two) keeps its last WINDOW times per thread count and keeps to
the count it settled on until the median of that count's recent times is SWITCH_MARGIN slower than the
other count's. Medians, because passes on two threads vary: on an idle VM one in ten took twice the
usual time, and a moving average that one such pass could tip (an earlier version) ran a third of a
server's decode passes on the slower count. A change that lasts (the other core became busy) shows in
three passes of five. Now and then it tries the other count, to notice that the machine changed: after
RETRY_EVERY passes at first, twice as long after each try that lost (up to MAX_RETRY_EVERY). A try is
TRY_PASSES passes whose times replace what that count had (they are news), and wins if their median
beats the settled count's; a single-pass try lost to noise as often as not, and then kept a server on
the slower count for hundreds of passes. A pass LOSS_FACTOR times slower than the settled count ends
a try at once, since a try of more threads while something else keeps the other cores busy can cost
ten passes' time; for the same reason more threads are tried only when, during the last pass on one
thread long enough to tell, the other cores were at least half idle
(/proc/stat); and when they turn free, a size settled on one thread tries more at its next pass.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

__all__ = ["ThreadChoice"]

T = TypeVar("T")

RETRY_EVERY = 16
MAX_RETRY_EVERY = 1024
WINDOW = 5  # recent passes per thread count whose median stands for it
SWITCH_MARGIN = 0.25  # how much slower than the other count the settled count must be to leave it
TRY_PASSES = 3
LOSS_FACTOR = 2.0
FREE_IDLE_SHARE = 0.5  # of the other cores' time, idle during a one-thread pass
MIN_TICKS = 5  # a shorter pass (in the other cores' clock ticks, 10 ms each) leaves the last judgement as it was


class _Size:
    """What is known about passes of one size."""

    def __init__(self):
        self.recent: dict[int, deque[float]] = {}  # threads -> the last WINDOW times of passes on that many
        self.settled: int | None = None  # the count passes use between tries (None: not every count measured)
        self.since_try = 0  # passes since the last try of the slower count
        self.retry_every = RETRY_EVERY
        self.trying: int | None = None  # the count being tried, while a try lasts
        self.try_passes = 0  # passes of the try so far

    def time(self, threads: int) -> float:
        return statistics.median(self.recent[threads])

    def fastest(self) -> int:
        return min(self.recent, key=self.time)


class ThreadChoice:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None] = lambda threads: None):
        self.options = (1, max_threads) if max_threads > 1 else (1,)
        self._set_threads = set_threads
        self._sizes: dict[int, _Size] = {}
        self.others_free = True  # whether the other cores looked free during the last one-thread pass
        self._others_ticks_per_s = os.sysconf("SC_CLK_TCK") * ((os.cpu_count() or 1) - 1)

    def run(self, rows: int, fn: Callable[[], T], threads: int | None = None) -> T:
        """fn() on `threads` (by default the count chosen for a pass of `rows`), timed and recorded; a
        pass on one thread also says whether the other cores are free."""
        threads = self.choose(rows) if threads is None else threads
        self._set_threads(threads)
        idle_before = _idle_ticks() if threads == 1 and self._may_judge(rows) else None
        started = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - started
        self.record(rows, threads, seconds)
        if idle_before is not None:
            self._judge_others(idle_before, seconds)
        return result

    def _may_judge(self, rows: int) -> bool:
        """Whether a one-thread pass of `rows` may last long enough to tell whether the other cores are
        free (MIN_TICKS): unknown yet, or one of its size's recent passes did. Reading /proc/stat before
        and after costs about 40 us (20 us a read here), which a small model's decode pass would pay
        at every pass for nothing."""
        size = self._sizes.get(rows.bit_length())
        recent = size.recent.get(1) if size is not None else None
        return not recent or max(recent) * self._others_ticks_per_s >= MIN_TICKS

    def _judge_others(self, idle_before: int, seconds: float) -> None:
        possible = seconds * self._others_ticks_per_s  # the other cores' ticks during the pass
        idle_after = _idle_ticks()
        if idle_after is not None and possible >= MIN_TICKS:
            was_free, self.others_free = self.others_free, (idle_after - idle_before) >= FREE_IDLE_SHARE * possible
            if self.others_free and not was_free:
                self._try_more_threads_soon()

    def _try_more_threads_soon(self) -> None:
        """The other cores turned free: what made a size settle on one thread (most often, they were busy)
        may be gone, so each such size tries more threads at its next pass, its backoff reset. Without
        this, a server whose lone session's passes had moved to one thread during a burst of sessions
        kept them there for as long as its grown backoff (85 against 57 ms a step, 14 Qwen3-shape blocks)."""
        for size in self._sizes.values():
            if size.settled == 1 and size.trying is None:
                size.retry_every = size.since_try = RETRY_EVERY

    def choose(self, rows: int) -> int:
        size = self._sizes.setdefault(rows.bit_length(), _Size())
        if size.trying is not None:
            return size.trying
        untried = [threads for threads in self.options if threads not in size.recent]
        if untried and (untried[0] == 1 or self.others_free):
            size.since_try = 0
            return untried[0]
        current = size.settled if size.settled is not None else size.fastest()
        size.since_try += 1
        other = self._other(current)
        try_due = other is not None and size.since_try >= size.retry_every
        if try_due and (other == 1 or self.others_free):
            size.since_try, size.trying, size.try_passes = 0, other, 0
            return other
        return current

    def record(self, rows: int, threads: int, seconds: float) -> None:
        size = self._sizes.setdefault(rows.bit_length(), _Size())
        recent = size.recent.setdefault(threads, deque(maxlen=WINDOW))
        if threads != size.settled and size.try_passes == 0:  # a first pass, or a try's: news
            recent.clear()
        recent.append(seconds)
        if size.settled is None:
            if len(size.recent) == len(self.options):
                size.settled = size.fastest()
        elif size.trying == threads:
            size.try_passes += 1
            clearly_lost = seconds > LOSS_FACTOR * size.time(size.settled)
            if clearly_lost or size.try_passes >= TRY_PASSES:
                won = not clearly_lost and size.time(threads) < size.time(size.settled)
                size.retry_every = RETRY_EVERY if won else min(2 * size.retry_every, MAX_RETRY_EVERY)
                size.trying, size.try_passes = None, 0
                if won:
                    size.settled = threads
        elif threads == size.settled:
            other = self._other(threads)
            if other is not None and size.time(threads) > (1 + SWITCH_MARGIN) * size.time(other):
                size.settled = other

    def _other(self, threads: int) -> int | None:
        return next((option for option in self.options if option != threads), None)


def _idle_ticks() -> int | None:
    """The machine's idle and iowait time so far, in clock ticks (None where there is no /proc/stat)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        return int(fields[4]) + int(fields[5])
    except (OSError, IndexError, ValueError):
        return None
