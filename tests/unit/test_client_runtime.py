"""The client's runtime (its event loop thread) shared by many threads, shutting down while they
use it: every caller gets an answer, none waits forever on a loop that no longer runs."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable

import pytest

from bloompeer.peer.client.errors import CallCancelledError, ClientShutDownError
from bloompeer.peer.client.runtime import Cancellation, ClientRuntime

from .api_fakes import SwarmWork

WAIT_S = 30.0  # far longer than anything here takes: only reached when something hangs


class Outcome:
    """A call made on a thread of its own: what it returned or raised, once it has."""

    def __init__(self, call: Callable[[], object]):
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)  # a hung one is left behind
        self.thread.start()

    def _run(self, call) -> None:
        try:
            self.value = call()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def wait(self, what: str) -> Outcome:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), f"hung: {what}"
        return self


async def _forever() -> None:
    await asyncio.Event().wait()


def test_a_call_made_while_the_runtime_shuts_down_is_refused_at_once_and_the_call_in_flight_ends():
    """As in `bloompeer api` at SIGTERM: a generation thread whose step the shutdown cancelled goes
    on to close its session, asking the runtime for more work while it is stopping."""
    runtime = ClientRuntime()
    started, cancelled, asked = threading.Event(), threading.Event(), threading.Event()

    async def in_flight() -> None:
        started.set()
        try:
            await _forever()
        except asyncio.CancelledError:
            cancelled.set()
            while not asked.is_set():  # the shutdown goes on once the other thread has asked for more
                await asyncio.sleep(0.01)
            raise

    def ask_when_cancelled():
        assert cancelled.wait(WAIT_S)
        try:
            future = runtime.submit(_forever())
        finally:
            asked.set()
        return future.result()

    running = Outcome(lambda: runtime.run(in_flight()))
    assert started.wait(WAIT_S)
    late = Outcome(ask_when_cancelled)
    Outcome(runtime.shutdown).wait("the shutdown")

    assert isinstance(late.wait("the call made during the shutdown").error, ClientShutDownError)
    assert isinstance(running.wait("the call in flight").error, ClientShutDownError)


def test_after_the_shutdown_every_call_is_refused_with_the_shutdown_error():
    runtime = ClientRuntime()
    runtime.shutdown()
    with pytest.raises(ClientShutDownError, match="shutting down"):
        runtime.run(asyncio.sleep(0))
    runtime.shutdown()  # idempotent


def test_a_call_that_ignores_its_cancellation_cannot_hang_the_shutdown():
    runtime = ClientRuntime(grace_s=0.2)
    started = threading.Event()

    async def stubborn() -> None:
        started.set()
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    running = Outcome(lambda: runtime.run(stubborn()))
    assert started.wait(WAIT_S)
    Outcome(runtime.shutdown).wait("the shutdown")
    assert isinstance(running.wait("the stubborn call's caller").error, ClientShutDownError)


def test_the_shutdown_runs_the_owners_teardown_after_the_calls_in_flight_have_ended():
    runtime = ClientRuntime()
    started, order = threading.Event(), []

    async def in_flight() -> None:
        started.set()
        try:
            await _forever()
        finally:
            order.append("call ended")

    async def teardown() -> None:
        order.append("teardown")

    running = Outcome(lambda: runtime.run(in_flight()))
    assert started.wait(WAIT_S)
    runtime.shutdown(last=teardown())
    assert order == ["call ended", "teardown"]
    assert isinstance(running.wait("the call in flight").error, ClientShutDownError)


SIGINTS = {  # a real SIGINT, delivered as the kernel chooses, or taken by another thread
    "to the process": lambda: os.kill(os.getpid(), signal.SIGINT),
    "to another thread": lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT),
}


@pytest.mark.parametrize("send_sigint", SIGINTS.values(), ids=SIGINTS.keys())
def test_a_wait_interrupted_by_ctrl_c_cancels_the_call_on_the_loop(send_sigint):
    """KeyboardInterrupt in the waiting thread must not leave the call running on the loop, streaming
    through the swarm for nobody. A SIGINT taken by another thread (as one is when it lands just before
    the waiting thread blocks on its lock) sets Python's flag without waking the waiter, which must notice
    it all the same: a wait that only an interrupted lock ends would last forever (it hung a CI run), so
    past WAIT_S the runtime is shut down, which ends the wait, and the test fails."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    runtime, in_flight, rescued = ClientRuntime(), SwarmWork().hold(), threading.Event()

    def interrupt_when_started() -> None:
        assert in_flight.started.wait(WAIT_S)
        send_sigint()
        if not in_flight.cancelled.wait(WAIT_S):
            rescued.set()
            runtime.shutdown()

    try:
        Outcome(interrupt_when_started)
        with pytest.raises(KeyboardInterrupt):
            runtime.run(in_flight())
        assert not rescued.is_set(), "the wait went on until the runtime was shut down"
        assert in_flight.cancelled.wait(WAIT_S), "the call went on running on the loop"
    finally:
        signal.signal(signal.SIGINT, previous)
        runtime.shutdown()


def test_a_cancelled_caller_has_its_call_in_flight_and_later_ones_cancelled_but_not_its_cleanup():
    runtime, cancellation, in_flight = ClientRuntime(), Cancellation(), SwarmWork().hold()

    async def cleanup() -> str:
        return "closed"

    def caller() -> list:
        outcomes = []
        with runtime.cancellable(cancellation):
            for call, cancellable in [(in_flight, True), (in_flight, True), (cleanup, False)]:
                try:
                    outcomes.append(runtime.run(call(), cancellable=cancellable))
                except CallCancelledError as exc:
                    outcomes.append(type(exc))
        return outcomes

    calls = Outcome(caller)
    assert in_flight.started.wait(WAIT_S)
    cancellation.cancel()
    assert calls.wait("the cancelled caller").value == [CallCancelledError, CallCancelledError, "closed"]
    assert in_flight.cancelled.is_set()
    runtime.shutdown()
