"""The client's one route/ban/retry loop, used by inference sessions, forwards and backwards alike.

A request goes to the best route the swarm view offers; when a server fails it, what happens
next follows the error's branch of the tree in `bloompeer/errors.py`:

- RequestError (the request can never succeed as asked): not caught, it reaches the caller at
  once, and no server is blamed;
- PeerRefusedError (over this server's limits): the server is avoided for this request only, never
  banned; when every server of some block has refused, the swarm view fails the request at once;
- PeerUnavailableError (busy, draining, timed out, stream lost, internal): the server is banned for
  a while, and the request is routed again and replayed;
- PeerMisbehavedError (broke the protocol): the server is banned for an hour, then as above.

Retrying ends with a MissingBlocksError once the recovery window after the first failure is spent.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ...p2p import PeerMisbehavedError, PeerRefusedError, RemoteError
from .errors import MissingBlocksError
from .health import MISBEHAVIOR_BAN_S, BanList
from .routing import RequestSize, RoutePlan
from .swarm import SwarmView

__all__ = ["Refusals", "blame", "on_a_route"]

T = TypeVar("T")
Refusals = dict[str, str]  # peer id -> why it refused this request (over its limits): not asked again for it


def blame(bans: BanList, error: RemoteError, refusals: Refusals) -> None:
    """What a server's failure costs it, by the error's branch."""
    if isinstance(error, PeerRefusedError):
        refusals[error.peer] = str(error)
    elif isinstance(error, PeerMisbehavedError):
        bans.ban(error.peer, str(error), duration_s=MISBEHAVIOR_BAN_S)
    else:
        bans.ban(error.peer, str(error))


async def on_a_route(swarm: SwarmView, start: int, end: int, attempt: Callable[[RoutePlan], Awaitable[T]],
                     request: RequestSize, refusals: Refusals, *, wait_s: float, recovery_s: float,
                     poll_period_s: float, min_cache_tokens: int = 0, failed: RemoteError | None = None,
                     push: bool | None = False) -> T:
    """`attempt(plan)` on the best route through blocks [start, end) for `request`, routed again
    after every server failure, until it succeeds.

    push: whether the route is for pushed steps (True), not (False), or whichever is faster (None;
    the plan says which was chosen).
    wait_s: how long the first routing waits for servers of missing blocks; recovery_s: how long
    retrying goes on after the first failure. failed: the failure that brought the caller here
    (blamed first; the recovery window starts now). `refusals` is the request's own, shared by
    every call made for it (a session keeps one for its whole life). An attempt that fails must
    release what it opened before raising.
    """
    deadline, error = None, failed
    if failed is not None:
        blame(swarm.bans, failed, refusals)
        deadline = time.monotonic() + recovery_s
    while True:
        timeout_s = wait_s if deadline is None else deadline - time.monotonic()
        if timeout_s <= 0:
            raise MissingBlocksError(swarm.model_uid, list(range(start, end)), recovery_s, str(error))
        try:
            plan = await swarm.plan(start, end, min_cache_tokens, timeout_s, poll_period_s, request, refusals, push)
        except MissingBlocksError as exc:
            if error is None:
                raise
            raise MissingBlocksError(swarm.model_uid, exc.missing, recovery_s, str(error)) from None
        try:
            return await attempt(plan)
        except RemoteError as exc:
            blame(swarm.bans, exc, refusals)
            error = exc
        deadline = deadline or time.monotonic() + recovery_s
