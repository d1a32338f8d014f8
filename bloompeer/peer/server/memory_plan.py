"""The memory a server will need, reckoned before it loads anything: its blocks' weights as stored
(--quant), any second copy of them, the attention cache budget and the process's fixed overhead,
against the memory available. `serve` logs the plan, refuses to start in one line when it does not
fit, and with a bare --num-blocks serves as many blocks as fit.

The fixed overhead is measured, not guessed: the process's own resident set when the plan is made
(interpreter, torch, transformers; before the network is joined and any block loaded), plus
WORKING_BYTES for what comes after (the DHT node, oneDNN's and MKL's kernels and buffers, thread
pools, a pass's activations). tests/swarm/test_quantized_servers.py holds a server's
RSS to 1.15x the plan's weights, cache in use and overhead, for each --quant.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ...blocks import Checkpoint
from ...errors import RequestError
from .config import ServerConfig
from .memory import CPU_MEMORY_SHARE, GPU_MEMORY_SHARE
from .quantization import WeightStorage

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
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _cgroup_room() -> int | None:
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as limit_file, open(usage_path) as usage_file:
                limit, usage = limit_file.read().strip(), usage_file.read().strip()
        except OSError:
            continue
        if limit == "max" or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - int(usage))
    return None


@dataclass(frozen=True)
class MemoryPlan:
    storage: WeightStorage
    num_blocks: int
    block_bytes: int  # one block as stored
    float_block_bytes: int  # one block in the model's dtype, for comparison
    copy_bytes: int  # weights copied to compute with (WeightStorage.working_copy_nbytes; batched passes copy none)
    cache_bytes: int  # the attention cache budget (--cache-tokens, or its default share)
    fixed_bytes: int  # the process before loading, plus WORKING_BYTES
    available_bytes: int  # the process's present RSS plus what it may still take

    @property
    def weights_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.copy_bytes + self.cache_bytes + self.fixed_bytes

    def __str__(self) -> str:
        return (f"weights {self.num_blocks} blocks x {self.block_bytes / _MIB:.1f} MiB as {self.storage} = "
                f"{self.weights_bytes / _MIB:.1f} MiB (float: {self.num_blocks * self.float_block_bytes / _MIB:.1f}), "
                f"copy {self.copy_bytes / _MIB:.0f} MiB, cache {self.cache_bytes / _MIB:.1f} MiB, fixed overhead "
                f"{self.fixed_bytes / _MIB:.1f} MiB; total {self.total_bytes / _MIB:.1f} MiB of "
                f"{self.available_bytes / _MIB:.1f} MiB available")


def plan_memory(config: ServerConfig, checkpoint: Checkpoint, num_blocks: int | None,
                storage: WeightStorage) -> MemoryPlan:
    """The plan for `num_blocks` blocks (None: as many as fit, at most the model's); MemoryPlanError
    if it does not fit."""
    dtype = getattr(torch, config.dtype)
    block_bytes = storage.block_nbytes(checkpoint, dtype)
    float_block_bytes = WeightStorage("none", storage.group_size).block_nbytes(checkpoint, dtype)
    on_cpu = torch.device(config.device).type == "cpu"
    fixed = (rss_bytes() if on_cpu else 0) + WORKING_BYTES
    copy = storage.working_copy_nbytes(checkpoint, dtype, config.device)
    available = available_bytes(config.device) + (fixed - WORKING_BYTES)
    block_cache_bytes = None  # --cache-tokens over one block
    if config.cache_tokens is not None:
        with torch.device("meta"):
            span = checkpoint.family.span_class(checkpoint.config(), 0, 1)
        block_cache_bytes = config.cache_tokens * span.cache_nbytes(1, 1, 1, dtype)
    if num_blocks is None:
        room = available - fixed - copy
        if block_cache_bytes is None:
            room *= FIT_WEIGHTS_SHARE
        num_blocks = min(checkpoint.config().num_hidden_layers,
                         max(0, int(room // (block_bytes + (block_cache_bytes or 0)))))
        if num_blocks == 0:
            raise MemoryPlanError(
                f"not one block fits: a block takes {block_bytes / _MIB:.1f} MiB as {storage} (and "
                f"{(block_cache_bytes or 0) / _MIB:.1f} MiB of --cache-tokens), and {max(0, room) / _MIB:.1f} MiB of "
                f"{available / _MIB:.1f} MiB is left for them after the fixed overhead ({fixed / _MIB:.1f} MiB); "
                f"try --quant int8 or int4, or a smaller --cache-tokens")
    if block_cache_bytes is not None:
        cache_bytes = block_cache_bytes * num_blocks
    else:  # the default: a share of what is left once the blocks are in (memory.default_cache_bytes)
        share = CPU_MEMORY_SHARE if on_cpu else GPU_MEMORY_SHARE
        cache_bytes = int(max(0, available - fixed - copy - num_blocks * block_bytes) * share)
    plan = MemoryPlan(storage, num_blocks, block_bytes, float_block_bytes, copy, cache_bytes, fixed, available)
    if plan.total_bytes > available or cache_bytes == 0:
        raise MemoryPlanError(f"not enough memory for this server: {plan}; serve fewer blocks (--blocks, "
                              f"--num-blocks), store them smaller (--quant int8 or int4) or lower --cache-tokens")
    return plan
