"""The client's event loop, on a background thread: the one place the sync API enters asyncio.

A model's forward and generate run in the caller's thread; every network operation is a
coroutine submitted here, so streams and the DHT node live in one loop for the model's life.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import uvloop
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["ClientRuntime"]

T = TypeVar("T")


class ClientRuntime:
    def __init__(self):
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bloompeer-client", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine in the client loop and wait for its result in the calling thread."""
        return self.submit(coroutine).result()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine in the client loop; its result comes when the caller asks for it."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("ClientRuntime called from its own loop; await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def shutdown(self) -> None:
        """Cancel whatever still runs in the loop (e.g. hivemind's background tasks), then stop it."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _cancel_other_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
