"""Everything a server is told at start, in one frozen value built by the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...p2p import DEFAULT_MAX_FRAME_BYTES, NetworkConfig
from ...weight_format import DEFAULT_GROUP_SIZE, WeightFormat

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    model: str  # local checkpoint directory or hub name
    start: int | None  # first block served (None: choose num_blocks_to_serve where the swarm is weakest)
    end: int | None  # one past the last block served
    # --num-blocks: how many blocks to choose when start and end are None (0: as many as memory fits)
    num_blocks_to_serve: int | None = None
    network: NetworkConfig = field(default_factory=NetworkConfig)
    device: str = "cpu"
    dtype: str = "float32"  # compute and cache dtype: float32, bfloat16 or float16
    quant: str = "none"  # how the blocks' linear weights are stored: none (in dtype), int8 or int4
    quant_group_size: int = DEFAULT_GROUP_SIZE  # inputs per 4-bit group (int4 only)
    announce_period_s: float = 30.0  # how often the DHT record is refreshed; it expires after 3 periods
    cache_tokens: int | None = None  # KV cache of all sessions, in tokens over the whole span (None: from free memory)
    session_timeout_s: float = 300.0  # a session with no step for this long is closed
    max_alloc_timeout_s: float = 60.0  # the longest an open waits for cache room, whatever the client asks
    max_batch_tokens: int = 2048  # rows (batch x tokens) in one pass; longer prefills run in chunks
    max_batch_sessions: int | None = None  # sessions whose steps share one pass (None: as many as fit; 1: no batching)
    batch_wait_s: float = 0.0  # how long a pass of inference steps may wait to fill (0: only for the last pass's sessions)
    max_step_tokens: int = 65536  # rows (batch x tokens) in one request; more is refused
    max_sessions_per_peer: int = 16
    max_batch: int = 64  # rows per session
    max_length: int = 8192  # tokens per session (prompt and generated)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # larger frames are refused unread
    throughput: float | None = None  # announced decode tokens/s through one block (None: measure once, cached)
    quick_throughput: bool = False  # measure it in a few steps and keep it nowhere (a swarm for one command)
    check_reachability: bool = True  # ask a peer to dial us back (False: a swarm on one machine, where all can)
    drain_timeout_s: float = 5.0  # on SIGTERM, how long open sessions get to move before the server exits
    choice_delay_s: float = 2.0  # --num-blocks waits up to this long (random) so that peers starting together differ
    # --num-blocks: how often (jittered by half) the server looks where the swarm needs blocks, and the
    # longest random wait before it looks again and moves. With a whole range killed, its records say
    # online until they expire (90 s); a look asks their servers, so the range is served again within
    # about a period, the wait, the drain timeout and a load (tests/swarm/test_rebalancing.py)
    rebalance_period_s: float = 10.0
    move_delay_s: float = 5.0
    metrics_port: int | None = None  # serve Prometheus metrics at http://metrics_host:PORT/metrics (0: any free port)
    metrics_host: str = "127.0.0.1"  # where the metrics endpoint listens (0.0.0.0: for a Prometheus elsewhere)

    @property
    def weights(self) -> WeightFormat:
        """How this server stores and computes its weights (dtype, quant, group size, device kind)."""
        return WeightFormat.of(self.quant, self.quant_group_size, self.dtype, self.device)

    @property
    def torch_dtype(self):
        import torch  # this module stays light: the command line builds configs before torch loads

        return getattr(torch, self.dtype)
