"""The memory a server will need, reckoned before it loads anything: its blocks' weights as stored
(--quant), any second copy of them, the attention cache and the process's fixed overhead, against
the memory available. `serve` logs the plan, refuses to start in one line when it does not fit, with
a bare --num-blocks serves as many blocks as fit, and gives its cache the plan's figure: the one
place that knows what is available (a container's cgroup limit as well as the host's free memory).

Blocks of one model may differ in size (stored_blocks.py): a plan for blocks a server will choose
later (--num-blocks K) counts the largest K consecutive blocks of the model.

The fixed overhead is measured, not guessed: the process's own resident set when the plan is made
(interpreter, torch, transformers; before the network is joined and any block loaded), plus
WORKING_BYTES for what comes after (the DHT node, oneDNN's and MKL's kernels and buffers, thread
pools, a pass's activations). tests/swarm/test_quantized_servers.py holds a server's
RSS to 1.15x the plan's weights, cache in use and overhead, for each --quant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ...blocks import Checkpoint, SessionCache
from ...blocks.kv_cache import CacheLayout, Layout
from ...blocks.recurrent_state import RecurrentLayout
from ...errors import RequestError
from ...weight_format import WeightFormat
from .config import ServerConfig
from .stored_blocks import StoredBlocks

__all__ = ["MemoryPlan", "MemoryPlanError", "available_bytes", "plan_memory", "rss_bytes"]

logger = logging.getLogger(__name__)

# What joining the network and the first passes add to a server's RSS beyond its weights and cache:
# RSS with 4 sessions open and stepped (a 16-token prefill, then batched decode steps) minus (RSS when
# the plan is made + weights + cache in use), 4 blocks of a Qwen3 shape of hidden 1024
# (tests/swarm/test_quantized_servers.py): 61 MiB (none, with the oneDNN kernels that batched
# passes build at load), 33 (int8), 26 (int4); with 8 sessions and a 64-token prefill, up to 81
WORKING_BYTES = 96 * 2**20
# With a bare --num-blocks and no --cache-tokens, blocks take at most this share of the memory left
# after the fixed overhead; the cache then gets its default share of what remains after loading
FIT_WEIGHTS_SHARE = 0.5
# Without --cache-tokens, the cache's share of what is left once the blocks are in: on the CPU the
# rest is the host's (and the OS's page cache); a GPU's memory is the server's alone
CPU_CACHE_SHARE = 0.5
GPU_CACHE_SHARE = 0.8
CGROUP_DIR = Path("/sys/fs/cgroup")  # where a container's memory limit is read (v2, else v1 under memory/)
MEMINFO_PATH = Path("/proc/meminfo")  # the host's MemAvailable (tests point both at files of their own)
_MIB = 2**20


class MemoryPlanError(RequestError):
    """The plan does not fit the memory available; the message names the flag to change."""


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def available_bytes(device: str) -> int:
    """Memory this process may still take: the device's free memory for CUDA; on the CPU the smaller
    of MemAvailable and the room left under the cgroup's limit (a container's)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open(MEMINFO_PATH) as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _cgroup_room() -> int | None:
    for limit_name, usage_name in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (CGROUP_DIR / limit_name).read_text().strip()
            usage = (CGROUP_DIR / usage_name).read_text().strip()
        except OSError:
            continue
        if limit == "max" or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - int(usage))
    return None


@dataclass(frozen=True)
class MemoryPlan:
    weights: WeightFormat
    num_blocks: int  # the blocks it serves
    weights_bytes: int  # their weights as stored (the largest such run of the model's blocks, if not chosen yet)
    float_weights_bytes: int  # the same blocks in the model's dtype, for comparison
    copy_bytes: int  # weights copied to compute with (StoredBlocks.working_copy_nbytes; batched passes copy none)
    cache_bytes: int  # the attention cache budget (--cache-tokens, or its default share): what the server uses
    fixed_bytes: int  # the process before loading, plus WORKING_BYTES
    available_bytes: int  # the process's present RSS plus what it may still take

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.copy_bytes + self.cache_bytes + self.fixed_bytes

    def __str__(self) -> str:
        return (f"weights of {self.num_blocks} blocks {self.weights_bytes / _MIB:.1f} MiB as {self.weights} "
                f"(float: {self.float_weights_bytes / _MIB:.1f}), copy {self.copy_bytes / _MIB:.0f} MiB, cache "
                f"{self.cache_bytes / _MIB:.1f} MiB, fixed overhead {self.fixed_bytes / _MIB:.1f} MiB; total "
                f"{self.total_bytes / _MIB:.1f} MiB of {self.available_bytes / _MIB:.1f} MiB available")


def plan_memory(config: ServerConfig, checkpoint: Checkpoint, wanted: range | int | None) -> MemoryPlan:
    """The plan for `wanted` blocks: these (a range), any run of this many (a count: chosen later), or
    as many as fit (None). MemoryPlanError if it does not fit."""
    stored = StoredBlocks(checkpoint, config.weights)
    on_cpu = torch.device(config.device).type == "cpu"
    fixed = (rss_bytes() if on_cpu else 0) + WORKING_BYTES
    copy = stored.working_copy_nbytes()
    available = available_bytes(config.device) + (fixed - WORKING_BYTES)
    token_bytes = _token_bytes(checkpoint, config.torch_dtype, 1)  # one token's cache over one block
    if wanted is None:
        block_cache = (config.cache_tokens or 0) * token_bytes + _session_bytes(checkpoint, config.torch_dtype, 1)
        wanted = _count_that_fits(config, stored, available - fixed - copy, block_cache)
    if isinstance(wanted, range):
        weights_bytes, num_blocks = stored.span_nbytes(wanted.start, wanted.stop), len(wanted)
        float_bytes = StoredBlocks(checkpoint, _float(config)).span_nbytes(wanted.start, wanted.stop)
    else:
        weights_bytes, num_blocks = stored.largest_span_nbytes(wanted), wanted
        float_bytes = StoredBlocks(checkpoint, _float(config)).largest_span_nbytes(wanted)
    session_bytes = _session_bytes(checkpoint, config.torch_dtype, num_blocks)
    if config.cache_tokens is not None:  # exactly --cache-tokens tokens over the blocks served, and one session
        cache_bytes = config.cache_tokens * _token_bytes(checkpoint, config.torch_dtype, num_blocks) + session_bytes
    else:
        share = CPU_CACHE_SHARE if on_cpu else GPU_CACHE_SHARE
        cache_bytes = int(max(0, available - fixed - copy - weights_bytes) * share)
    plan = MemoryPlan(config.weights, num_blocks, weights_bytes, float_bytes, copy, cache_bytes, fixed, available)
    if plan.total_bytes > available or cache_bytes < session_bytes + token_bytes:  # not even one session
        raise MemoryPlanError(f"not enough memory for this server: {plan}; serve fewer blocks (--blocks, "
                              f"--num-blocks), store them smaller (--quant int8 or int4) or lower --cache-tokens")
    return plan


def _count_that_fits(config: ServerConfig, stored: StoredBlocks, room: int, cache_per_block: int) -> int:
    """The most blocks any run of which fits in `room` with its cache (--cache-tokens and a session's state;
    by default the blocks take at most FIT_WEIGHTS_SHARE of it), at most the model's."""
    if config.cache_tokens is None:
        room *= FIT_WEIGHTS_SHARE
    count = 0
    for length in range(1, len(stored.block_nbytes) + 1):
        if stored.largest_span_nbytes(length) + length * cache_per_block > room:
            break
        count = length
    if count == 0:
        largest = max(stored.block_nbytes)
        raise MemoryPlanError(
            f"not one block fits: the largest takes {largest / _MIB:.1f} MiB as {stored.weights} (and "
            f"{cache_per_block / _MIB:.1f} MiB of --cache-tokens), and {max(0, room) / _MIB:.1f} MiB is left for "
            f"them after the fixed overhead; try --quant int8 or int4, or a smaller --cache-tokens")
    return count


def _layouts(checkpoint: Checkpoint) -> set[Layout]:
    config = checkpoint.config()
    return {checkpoint.family.span_class.cache_layout(config, i) for i in range(config.num_hidden_layers)}


def _token_bytes(checkpoint: Checkpoint, dtype: torch.dtype, num_blocks: int) -> int:
    """Cache bytes of one token over any `num_blocks` blocks, as a session's cache counts them: the family's
    largest per-token block layout (kv_cache.py) times num_blocks, and its padding mask once per session, not
    per block. Any run of a hybrid model's blocks is counted as if all were attention blocks (at most that)."""
    per_token = [layout for layout in _layouts(checkpoint) if isinstance(layout, CacheLayout)]
    if not per_token:
        return SessionCache.nbytes_per_token([], dtype)
    return SessionCache.nbytes_per_token([max(per_token, key=lambda layout: layout.nbytes_per_token(dtype))]
                                         * num_blocks, dtype)


def _session_bytes(checkpoint: Checkpoint, dtype: torch.dtype, num_blocks: int) -> int:
    """What one session of one row takes whatever its length over any `num_blocks` blocks: their recurrent
    state, counted as if all were recurrent blocks (at most that); 0 for a model without any."""
    recurrent = [layout for layout in _layouts(checkpoint) if isinstance(layout, RecurrentLayout)]
    return SessionCache.nbytes_per_session(recurrent[:1] * num_blocks, 1, dtype)


def _float(config: ServerConfig) -> WeightFormat:
    return WeightFormat.of("none", dtype=config.dtype, device=config.device)
