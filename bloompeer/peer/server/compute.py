"""The server's compute thread: every torch call on the serving path runs here, off the event loop.

One thread per device keeps a forward from stalling the network and keeps kernels from
competing for the same cores.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["ComputeWorker"]

T = TypeVar("T")


class ComputeWorker:
    def __init__(self, name: str = "bloompeer-compute"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
