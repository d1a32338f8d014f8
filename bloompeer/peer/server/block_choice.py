"""`serve --num-blocks K`: which K consecutive blocks to serve, where the swarm is weakest."""

from __future__ import annotations

from ...p2p import ServerRecord, ServerState

__all__ = ["choose_blocks"]

# A server that has not announced a throughput yet (it is still loading) still covers its
# blocks: it counts as this much, so that uncovered blocks are chosen before covered ones.
UNMEASURED_THROUGHPUT = 1e-3


def choose_blocks(servers: dict[int, list[ServerRecord]], num_blocks: int, count: int) -> tuple[int, int]:
    """The window of `count` blocks with the least announced throughput (the first one on ties)."""
    if not 0 < count <= num_blocks:
        raise ValueError(f"--num-blocks must be between 1 and the model's {num_blocks} blocks, not {count}")
    strength = [
        sum(max(r.throughput, UNMEASURED_THROUGHPUT) for r in servers.get(index, ())
            if r.state in (ServerState.JOINING, ServerState.ONLINE))
        for index in range(num_blocks)
    ]
    start = min(range(num_blocks - count + 1), key=lambda s: (sum(strength[s:s + count]), s))
    return start, start + count
