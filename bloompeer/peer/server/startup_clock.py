"""Where a server's start went: seconds per step, logged in one line once it is online."""

from __future__ import annotations

import time

__all__ = ["StartupClock"]


class StartupClock:
    """Seconds spent on each step of a server's start, logged in one line once it is online: where
    a slow start went (the benchmarks read it too)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._started = self._last = time.monotonic()

    def add_network(self, started: float, node_seconds: dict[str, float], checked_reachability: bool) -> None:
        """Joining the network: the node's own steps, and the reachability check (the rest of it)."""
        self._started, self._last = started, time.monotonic()
        self.seconds.update(node_seconds)
        if checked_reachability:
            self.seconds["reachability check"] = max(0.0, self._last - started - sum(node_seconds.values()))

    def lap(self, step: str) -> None:
        now = time.monotonic()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - self._last
        self._last = now

    def __str__(self) -> str:
        steps = ", ".join(f"{step} {seconds:.2f} s" for step, seconds in self.seconds.items())
        return f"{self._last - self._started:.2f} s: {steps}"
