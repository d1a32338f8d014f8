"""How fast this server computes, announced so clients can estimate routes and new servers can
find where the swarm is weakest.

Throughput is tokens per second through one block during decoding (batch 1, one token per
step, with a cache), measured once after loading and kept on disk per model, device and dtype.
A quick estimate (a few steps, for a swarm that lives for one command) is never kept: it would
stand for a real measurement in later runs.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from ...blocks import BlockSpan, Checkpoint
from .compute import ComputeWorker
from .config import ServerConfig

__all__ = ["MEASURE_STEPS", "QUICK_STEPS", "measure_throughput", "cached_throughput", "server_throughput"]

logger = logging.getLogger(__name__)

MEASURE_STEPS = 16
QUICK_STEPS = 2
WARM_UP_STEPS = 2  # the first steps warm up kernels and allocators


def cache_dir() -> Path:
    """Where measured throughputs are kept between runs: $BLOOMPEER_CACHE, else
    $XDG_CACHE_HOME/bloompeer, else ~/.cache/bloompeer."""
    if "BLOOMPEER_CACHE" in os.environ:
        return Path(os.environ["BLOOMPEER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bloompeer"


def measure_throughput(span: BlockSpan, device: str, dtype: torch.dtype, steps: int = MEASURE_STEPS) -> float:
    """Decode steps through the whole span: tokens/s through one block."""
    warm_up = min(WARM_UP_STEPS, steps)
    cache = span.new_cache(span.start, span.end, 1, steps + warm_up, dtype, device)
    hidden = torch.randn(1, 1, span.config.hidden_size, dtype=dtype, device=device)
    with torch.inference_mode():
        for position in range(steps + warm_up):
            if position == warm_up:
                started = time.perf_counter()
            span(hidden, cache.begin_step(position, None, 1), cache)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    seconds_per_block = (time.perf_counter() - started) / steps / span.num_blocks
    return 1.0 / seconds_per_block


def cached_throughput(key: str, measure, keep: bool = True) -> float:
    """The throughput stored under `key`, or `measure()` (then stored, if `keep`)."""
    path = cache_dir() / "throughput.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), (int, float)):
        return float(known[key])
    throughput = measure()
    if not keep:
        return throughput
    known[key] = throughput
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("Could not save the measured throughput to %s: %s", path, exc)
    return throughput


async def server_throughput(span: BlockSpan, config: ServerConfig, checkpoint: Checkpoint,
                            compute: ComputeWorker) -> float:
    """The throughput a server announces for `span`, measured on its compute thread once per model,
    device, dtype, weight format and torch version, then read from the cache; a quick estimate
    (--quick-throughput) is only for this run."""
    dtype, weights = config.torch_dtype, config.weights
    key = f"{checkpoint.fingerprint()}|{config.device}|{config.dtype}|{torch.__version__}"
    if weights.quantized:
        key += f"|{weights.quant}|{weights.group_size}"
    steps = QUICK_STEPS if config.quick_throughput else MEASURE_STEPS

    def measure() -> float:
        throughput = measure_throughput(span, config.device, dtype, steps)
        if config.quick_throughput:
            logger.info("Estimated the throughput in %d steps (--quick-throughput: not kept)", steps)
        return throughput

    return await compute.run(cached_throughput, key, measure, not config.quick_throughput, rows=1)
