"""How many threads OpenBLAS gets for a batched decode pass: the count that recent passes of that size
ran faster with.

Why measured, not set: OpenBLAS splits each of a batched pass's linear layers (blocks/batched_linear.py)
across its threads and waits for the slowest. With the second core free that is much faster; with
something else keeping it busy, every layer waits for a descheduled thread. 8 rows through 12 blocks
of hidden 1024: 122 ms on two threads, 139 ms on one, and 394 ms on two with a busy loop on the other
core. On a server that shares its cores with its p2p daemon, its clients or anything else, no reading
taken before a pass says which case it is in; the pass's own time says so afterwards.

So each size of pass (rows, by powers of two) keeps a moving average of its time per thread count,
uses the faster, and every RETRY_EVERY passes tries the other once, to notice that the machine changed.
A try's time replaces that count's old average (it is news, not noise), so one try is enough to
switch back; a wrong try costs one slow pass in RETRY_EVERY.
"""

from __future__ import annotations

__all__ = ["BlasThreadChoice"]

RETRY_EVERY = 16
SMOOTHING = 0.3  # weight of the newest pass in the moving average: one slow pass is enough to switch


class BlasThreadChoice:
    def __init__(self, max_threads: int):
        self.options = (1, max_threads) if max_threads > 1 else (1,)
        self._seconds: dict[tuple[int, int], float] = {}  # (size, threads) -> moving average of a pass
        self._passes: dict[int, int] = {}  # size -> passes chosen so far
        self._last: dict[int, int] = {}  # size -> the thread count its last pass ran with

    def choose(self, rows: int) -> int:
        size = rows.bit_length()
        untried = [threads for threads in self.options if (size, threads) not in self._seconds]
        if untried:
            return untried[0]
        self._passes[size] = self._passes.get(size, 0) + 1
        ranked = sorted(self.options, key=lambda threads: self._seconds[size, threads])
        return ranked[-1] if self._passes[size] % RETRY_EVERY == 0 else ranked[0]

    def record(self, rows: int, threads: int, seconds: float) -> None:
        size = rows.bit_length()
        previous = self._seconds.get((size, threads))
        if previous is None or self._last.get(size) != threads:
            self._seconds[size, threads] = seconds
        else:
            self._seconds[size, threads] = previous + SMOOTHING * (seconds - previous)
        self._last[size] = threads
