"""Where an inference step's time goes on a server, phase by phase (benchmarks/step_anatomy.py reads them).

A step's time here runs from its frame's last byte in to its answer written. Each phase is one
stretch of that path, observed per step in `bloompeer_server_step_phase_seconds{phase}`:

  decode   the frame unpacked, its tensors read, the request checked, until it is queued;
  queue    waiting for the compute thread (other passes, a batch being gathered, the hand-off);
  compute  its pass through the blocks (a pass that batches several steps counts for each);
  resume   from the pass's end on the compute thread to the step's task running on the event loop;
  encode   the output encoded and written to the hop that waits for it: the next server where the
           client asked for a push, else the client (a pushing server's answer to its client, which
           only keeps a copy, is not on the step's path and not timed).

All times are time.perf_counter(), one clock for every thread of the process.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass

__all__ = ["PHASES", "StepClock"]

PHASES = ("decode", "queue", "compute", "resume", "encode")


@dataclass
class StepClock:
    received: float  # the step's frame was all in
    queued: float | None = None  # its first pass was asked for
    queue_s: float = 0.0  # a step larger than a pass runs as several passes: their waits and times add up
    compute_s: float = 0.0
    pass_ended: float = 0.0
    output_ready: float = 0.0
    sent: float = 0.0  # the output was written to the hop that waits for it

    def add_pass(self, submitted: float, started: float, ended: float) -> None:
        """One pass of this step: asked for at `submitted`, run on the compute thread from `started` to `ended`."""
        if self.queued is None:
            self.queued = submitted
        self.queue_s += started - submitted
        self.compute_s += ended - started
        self.pass_ended = ended

    def output_is_ready(self) -> None:
        self.output_ready = time.perf_counter()

    async def time_sending(self, delivery: Awaitable[None]) -> None:
        """Await the delivery of the output to the hop that waits for it, noting when it was written."""
        await delivery
        self.sent = time.perf_counter()

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, for a step whose output was sent."""
        return {"decode": self.queued - self.received, "queue": self.queue_s, "compute": self.compute_s,
                "resume": self.output_ready - self.pass_ended, "encode": self.sent - self.output_ready}
