"""StepClock: a step's time on a server split into phases that add up to the stretch they cover."""

import time

from bloompeer.peer.server.step_clock import PHASES, StepClock


def test_a_step_of_two_passes_adds_their_waits_and_computes():
    clock = StepClock(received=10.0)
    clock.add_pass(submitted=10.5, started=11.0, ended=13.0)
    clock.add_pass(submitted=13.0, started=13.25, ended=14.0)
    clock.output_ready, clock.sent = 14.5, 15.0
    phases = clock.phases()
    assert list(phases) == list(PHASES)
    assert phases == {"decode": 0.5, "queue": 0.75, "compute": 2.75, "resume": 0.5, "encode": 0.5}
    assert sum(phases.values()) == 15.0 - 10.0  # no gap between the passes here: the phases cover it all


async def test_the_step_is_sent_when_the_delivery_the_chain_waits_for_is_written():
    clock, written = StepClock(received=0.0), []

    async def deliver():
        written.append(time.perf_counter())

    await clock.time_sending(deliver())
    assert written and written[0] <= clock.sent <= time.perf_counter()
