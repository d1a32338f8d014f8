"""Importing torch, transformers and hivemind with the garbage collector paused.

Those imports build a heap of about 400k objects that stay alive until the process exits. While
they are being made, CPython's cyclic collector runs about 960 times, 6 of them over the whole
heap, and finds nothing to free: 0.9 s of the 6 s that the client's imports take on one core of
this project's 2-core VM. So heavy imports run with the collector paused, and what they made is
then frozen: moved where no later collection walks it again. That also spares a forked peer
(local_swarm.py) from copying the pages of that heap when it collects (Python's documentation
of gc.freeze recommends freezing before a fork for that reason).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["imports_without_gc"]


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """Run the block (imports, and the module-level state they build) with the collector paused;
    freeze what exists at its end. Nests; restores the collector's state on exit."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
