"""Everything a client is told, in one frozen value (built by the CLI or from_pretrained's arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...p2p import NetworkConfig
from ...weight_format import QUANT_KINDS

__all__ = ["ClientConfig"]


@dataclass(frozen=True)
class ClientConfig:
    network: NetworkConfig = field(default_factory=lambda: NetworkConfig(client_mode=True))
    request_timeout_s: float = 30.0  # one step or forward on one server, including its queueing
    alloc_timeout_s: float = 10.0  # how long a busy server may keep a new session waiting for cache room
    missing_blocks_timeout_s: float = 60.0  # how long to wait for a server to cover every block
    recovery_timeout_s: float = 60.0  # how long to keep re-routing around failing servers before giving up
    poll_period_s: float = 1.0  # how often the DHT is read again while waiting for missing blocks
    swarm_refresh_period_s: float = 10.0  # how often the view of the swarm is read from the DHT in the background
    # servers pass each step's output straight to the next server (True), or the client sends it to
    # each in turn (False); None: chosen with each session's route, from the measured round trips to
    # and between the servers: push where it saves enough (far-apart servers, benchmarks/wan.py), not
    # on one machine's loopback, where it saved nothing (benchmarks/inference.py)
    push: bool | None = None
    verify_fraction: float = 0.0  # share of each span's steps recomputed elsewhere to catch a lying server
    trusted_servers: tuple[str, ...] = ()  # if set, only these peer ids (base58) are ever used
    # only servers storing their weights in one of these ways (none, int8, int4) are used, for routing,
    # replay and verification alike; ("none",) alone asks for exact results (`exact`)
    quant_allowed: tuple[str, ...] = QUANT_KINDS
    wire_codec: str = "raw"  # how forward/backward activations and gradients travel: raw, float16, bfloat16, int8-blockwise
    max_rows_per_request: int = 2048  # a larger forward or backward batch (batch x length) is sent in parts

    @property
    def exact(self) -> bool:
        """Results equal to the model's own on one machine: only unquantized servers are used, and
        only those computing in the client's dtype (a bfloat16 server is a few percent off float32)."""
        return set(self.quant_allowed) == {"none"}
