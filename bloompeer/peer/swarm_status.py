"""The swarm's state for one model as plain data: what `bloompeer status --json` prints and the
API's dashboard shows (one function, so the two never drift apart)."""

from __future__ import annotations

from typing import Any

from ..p2p import ServerRecord

__all__ = ["status_data"]


def status_data(model_uid: str, num_blocks: int, servers: dict[int, list[ServerRecord]]) -> dict[str, Any]:
    """{"model", "num_blocks", "missing": [block indices nobody serves], "blocks": [{"index", "servers":
    [DHT record as on the wire]}]}, from BlockDirectory.find_servers' answer."""
    blocks = [{"index": i, "servers": [record.to_wire() for record in servers.get(i, [])]} for i in range(num_blocks)]
    missing = [i for i in range(num_blocks) if not servers.get(i)]
    return {"model": model_uid, "num_blocks": num_blocks, "missing": missing, "blocks": blocks}
