"""The swarm's state for one model as plain data: what `bloompeer status --json` prints and the
API's dashboard shows (one function, so the two never drift apart)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..p2p import ServerRecord, ServerState

__all__ = ["describe_experts", "missing_blocks", "status_data", "weights_on_offer"]


def status_data(model_uid: str, num_model_blocks: int, servers: dict[int, list[ServerRecord]],
                experts: Sequence[tuple[int, int]] | None = None) -> dict[str, Any]:
    """{"model", "num_blocks" (the model's), "missing": [block indices no online server covers], "weights":
    the ways online servers store the weights (weights_on_offer), "blocks": [{"index", "experts" and
    "experts_per_token" (0 for a dense block), "servers": [DHT record as on the wire, plus "weights":
    WeightFormat.label]}]}, from BlockDirectory.find_servers' answer and the model's experts per block
    (BlockSpan.experts_of; None: dense). Its keys are what `bloompeer status --json` and the API's
    dashboard print: they stay as they are."""
    experts = experts or ((0, 0),) * num_model_blocks
    blocks = [{"index": i, "experts": experts[i][0], "experts_per_token": experts[i][1],
               "servers": [{**record.to_wire(), "weights": record.weights.label} for record in servers.get(i, [])]}
              for i in range(num_model_blocks)]
    missing = missing_blocks(num_model_blocks, servers)
    return {"model": model_uid, "num_blocks": num_model_blocks, "missing": missing,
            "weights": weights_on_offer(servers), "blocks": blocks}


def describe_experts(experts: Sequence[tuple[int, int]]) -> str | None:
    """A mixture of experts in words ("128 experts a block, 8 used a token; dense: block 0"), None if dense."""
    sparse = sorted({pair for pair in experts if pair[0]})
    if not sparse:
        return None
    text = "; ".join(f"{count} experts a block, {per_token} used a token" for count, per_token in sparse)
    dense = [str(index) for index, (count, _) in enumerate(experts) if not count]
    return f"{text}; dense: block{'s' if len(dense) > 1 else ''} {', '.join(dense)}" if dense else text


def weights_on_offer(servers: dict[int, list[ServerRecord]]) -> list[str]:
    """The ways online servers store the model's weights (WeightFormat.label), sorted."""
    return sorted({r.weights.label for records in servers.values() for r in records if r.state is ServerState.ONLINE})


def missing_blocks(num_model_blocks: int, servers: dict[int, list[ServerRecord]]) -> list[int]:
    """Blocks that no server announcing itself online covers (a joining, draining or offline one does not count)."""
    return [i for i in range(num_model_blocks)
            if not any(r.state is ServerState.ONLINE for r in servers.get(i, []))]
