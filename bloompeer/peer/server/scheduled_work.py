"""What the scheduler (scheduler.py) queues for the compute thread: a request's work with its priority, and
what it remembers of a group's last pass (the sessions it held, how long it took, how many rows)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from ...blocks import Segment

__all__ = ["Pass", "Priority", "Work", "prompts_within"]


class Priority(IntEnum):
    INFERENCE = 0
    FORWARD = 1
    BACKWARD = 2


@dataclass(order=True)
class Work:
    """A request waiting for the compute thread. Inference work has a `segment` and may share a
    pass with other inference work of the same `group` (block range); other work has `run`."""

    priority: Priority
    order: int  # FIFO within a priority
    group: tuple = field(compare=False)
    rows: int = field(compare=False)
    segment: Callable[[], Segment] | None = field(compare=False, default=None)  # on the compute thread
    run: Callable[[], Any] | None = field(compare=False, default=None)  # on the compute thread
    rollback: Callable[[], None] = field(compare=False, default=lambda: None)
    finish: Callable[[torch.Tensor], torch.Tensor] = field(compare=False, default=lambda output: output)
    future: asyncio.Future = field(compare=False, default=None)
    session: str | None = field(compare=False, default=None)  # an inference step's Session.id
    submitted: float = field(compare=False, default=0.0)  # time.perf_counter() when queued
    started: float = field(compare=False, default=0.0)  # its pass on the compute thread
    ended: float = field(compare=False, default=0.0)


@dataclass(frozen=True)
class Pass:
    """A group's last inference pass: what gathering (the sessions to wait for) and running a lone session's
    step at once (its time and rows) go by."""

    sessions: frozenset[str]
    seconds: float
    rows: int


def prompts_within(prompts: torch.Tensor | None, begin: int, end: int) -> torch.Tensor | None:
    """The deep prompts for the new tokens [begin, end) of a step (they cover its first k tokens)."""
    if prompts is None or begin >= prompts.shape[2]:
        return None
    return prompts[:, :, begin:end]
