"""The swarm as the API sees it now: the DHT's records for the model (as `bloompeer status --json`
prints them) and this client's measured round-trip time to each server; and, for /health, the
blocks this client has no usable server for.

The lookup runs on the client's event loop (where its DHT node lives), called from a worker
thread so the HTTP event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from starlette.concurrency import run_in_threadpool

from ...blocks import family_for_model_type
from ..swarm_status import status_data

__all__ = ["fetch_swarm_state", "fetch_unserved_blocks"]


async def _lookup(swarm_client) -> tuple[dict, dict[str, float]]:
    view = swarm_client.swarm
    servers = await swarm_client.node.directory.find_servers(view.model_uid, view.num_model_blocks)
    return servers, dict(view.rtts_s)


async def fetch_swarm_state(model) -> dict[str, Any]:
    """status_data(...) plus "latency_s": {peer id: seconds or None (not measured, or no answer)}."""
    swarm_client = model.client
    servers, rtts_s = await run_in_threadpool(swarm_client.runtime.run, _lookup(swarm_client))
    view, config = swarm_client.swarm, model.config
    experts = family_for_model_type(config.model_type).span_class.experts_of(config)
    state = status_data(view.model_uid, view.num_model_blocks, servers, experts)
    peers = {record.peer_id for records in servers.values() for record in records}
    state["latency_s"] = {peer: rtts_s[peer] if math.isfinite(rtts_s.get(peer, math.inf)) else None
                          for peer in sorted(peers)}
    return state



async def fetch_unserved_blocks(model) -> list[int]:
    """The blocks a request would wait for now (SwarmView.unserved_blocks): no DHT lookup, so a probe
    every second costs nothing."""
    swarm_client = model.client
    return await asyncio.wrap_future(swarm_client.runtime.submit(swarm_client.swarm.unserved_blocks()))
