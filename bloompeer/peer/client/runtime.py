"""The client's event loop, on a background thread: the one place the sync API enters asyncio.

A model's forward and generate run in the caller's thread; every network operation is a
coroutine submitted here, so streams and the DHT node live in one loop for the model's life.

Many threads share one runtime (an HTTP server calls the model from each request's thread), and
any of them may be waiting on it when it shuts down, so shutting down is a protocol, not a stop:
from its first moment new work is refused (ClientShutDownError, at once), the work in flight is
cancelled and its callers get the same error, and only then does the loop stop; no caller is
ever left waiting on a loop that no longer runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import uvloop

from .errors import CallCancelledError, ClientShutDownError

__all__ = ["Cancellation", "ClientRuntime"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

SHUTDOWN_GRACE_S = 5.0  # how long cancelled work may take to wind down (close its sessions) at shutdown
# A waiting thread wakes this often: a SIGINT whose handler ran just before the thread blocked on its lock
# does not interrupt the lock (the signal was already taken), so only a timed wait lets Ctrl-C through
SIGNAL_CHECK_S = 0.25


class Cancellation:
    """One caller's handle on the runtime work it waits for, to be cancelled from another thread.

    A worker thread runs a model call inside `runtime.cancellable(cancellation)`; whoever started it
    (an HTTP request whose client left) calls cancel(), which cancels on the loop the work that
    thread waits for now, and refuses what it asks for later (CallCancelledError in that thread),
    so the call stops computing through the swarm instead of running to its end. Calls made with
    cancellable=False (closing a session) still run. Thread-safe; cancel() never blocks.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._cancelled = False
        self._tasks: dict[asyncio.Task, asyncio.AbstractEventLoop] = {}

    def is_set(self) -> bool:
        """Whether cancel() was called (so that it reads like the threading.Event it replaces)."""
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            tasks = list(self._tasks.items())
        for task, loop in tasks:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its work has ended already
                loop.call_soon_threadsafe(task.cancel)

    def _attach(self, task: asyncio.Task) -> bool:
        """Follow a task (on the loop it runs in); False if cancelled already (it must not start)."""
        with self._lock:
            if self._cancelled:
                return False
            self._tasks[task] = task.get_loop()
            return True

    def _detach(self, task: asyncio.Task) -> None:
        with self._lock:
            self._tasks.pop(task, None)


THREAD_NAME = "bloompeer-client"  # the network thread's name (benchmarks/step_anatomy.py finds it by it)


class ClientRuntime:
    def __init__(self, grace_s: float = SHUTDOWN_GRACE_S):
        self.grace_s = grace_s
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=THREAD_NAME, daemon=True)
        self._lock = threading.Lock()  # guards _closing and _pending between submitting and shutting down
        self._closing = False
        self._pending: set[concurrent.futures.Future] = set()  # submitted, not done: failed if left at the end
        self._running: set[asyncio.Task] = set()  # their tasks, on the loop: cancelled first at shutdown
        self._shutdown_lock = threading.Lock()  # one shutdown at a time; a second waits for the first
        self._callers = threading.local()  # each thread's Cancellation, if it runs in cancellable()
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], cancellable: bool = True) -> T:
        """Run a coroutine in the client loop and wait for its result in the calling thread.

        If the wait itself is interrupted (KeyboardInterrupt, or any BaseException in this thread),
        the coroutine is cancelled too, rather than left running on the loop for nobody.
        cancellable=False: not cancelled by this thread's Cancellation (see cancellable()), for
        clean-up that must run even then (closing a session frees the servers' caches).
        """
        cancellation = getattr(self._callers, "cancellation", None) if cancellable else None
        future = self.submit(coroutine, cancellation)
        try:
            while True:
                try:
                    return future.result(timeout=SIGNAL_CHECK_S)
                except TimeoutError:
                    if future.done():  # the coroutine's own TimeoutError
                        raise
        except BaseException:
            future.cancel()  # a no-op if it is done; else its task is cancelled on the loop
            raise

    def submit(self, coroutine: Coroutine[Any, Any, T],
               cancellation: Cancellation | None = None) -> concurrent.futures.Future[T]:
        """Start a coroutine in the client loop; its result comes when the caller asks for it.

        Raises ClientShutDownError once shutdown has begun. `cancellation`: cancelling it cancels
        the coroutine (its future then raises CallCancelledError)."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("ClientRuntime called from its own loop; await the coroutine instead")
        with self._lock:
            if self._closing:
                coroutine.close()
                raise ClientShutDownError("the client is shutting down: it takes no new work")
            future = asyncio.run_coroutine_threadsafe(self._guarded(coroutine, cancellation), self._loop)
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    @contextlib.contextmanager
    def cancellable(self, cancellation: Cancellation) -> Iterator[None]:
        """Within it, this thread's run() calls are cancelled by `cancellation` (see Cancellation)."""
        outer, self._callers.cancellation = getattr(self._callers, "cancellation", None), cancellation
        try:
            yield
        finally:
            self._callers.cancellation = outer

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    async def _guarded(self, coroutine: Coroutine[Any, Any, T], cancellation: Cancellation | None) -> T:
        """The coroutine as submitted work: followed so that shutdown (or its Cancellation) can cancel
        it, and its cancellation turned into an error that says why."""
        task = asyncio.current_task()
        self._running.add(task)
        try:
            if self._closing:
                raise ClientShutDownError("the client is shutting down: it takes no new work")
            if cancellation is not None and not cancellation._attach(task):
                raise CallCancelledError("the call was cancelled by its caller before it started")
            return await coroutine
        except asyncio.CancelledError:
            if self._closing:
                raise ClientShutDownError("the client shut down while this call was running") from None
            if cancellation is not None and cancellation.is_set():
                raise CallCancelledError("the call was cancelled by its caller") from None
            raise
        finally:
            coroutine.close()  # a no-op once it ran; if it never started, no "never awaited" warning
            self._running.discard(task)
            if cancellation is not None:
                cancellation._detach(task)

    def shutdown(self, last: Coroutine[Any, Any, Any] | None = None) -> None:
        """Refuse new work, cancel the work in flight (its callers get ClientShutDownError), run `last`
        (the owner's own teardown, e.g. its network peer's), cancel whatever else still runs (e.g.
        hivemind's background tasks), stop the loop, and fail any future still pending. Idempotent
        and thread-safe: a later call waits for the first to finish (its `last` is not run)."""
        with self._lock:
            self._closing = True
        with self._shutdown_lock:
            if self._loop.is_closed():
                if last is not None:
                    last.close()
                return
            try:
                asyncio.run_coroutine_threadsafe(self._wind_down(last), self._loop).result()
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()
                self._fail_pending()

    async def _wind_down(self, last: Coroutine[Any, Any, Any] | None) -> None:
        await _cancel_and_wait(self._running - {asyncio.current_task()}, self.grace_s)
        if last is not None:
            try:
                await last
            except Exception:
                logger.warning("Shutting down the client failed", exc_info=True)
        await _cancel_and_wait(asyncio.all_tasks() - {asyncio.current_task()}, self.grace_s)

    def _fail_pending(self) -> None:
        """Futures whose work did not end within the grace period: nothing will complete them now."""
        with self._lock:
            pending, self._pending = list(self._pending), set()
        for future in pending:
            with contextlib.suppress(concurrent.futures.InvalidStateError, RuntimeError):  # done meanwhile
                if future.set_running_or_notify_cancel():
                    future.set_exception(ClientShutDownError("the client shut down while this call was running"))


async def _cancel_and_wait(tasks: set[asyncio.Task], timeout_s: float) -> None:
    """Cancel the tasks and wait for them to end, at most timeout_s (one that ignores cancellation
    is left behind rather than allowed to hang the shutdown)."""
    for task in tasks:
        task.cancel()
    if tasks:
        _, stuck = await asyncio.wait(tasks, timeout=timeout_s)
        if stuck:
            logger.warning("%d task(s) did not end within %.0f s of being cancelled: %s", len(stuck), timeout_s,
                           ", ".join(task.get_name() for task in stuck))
