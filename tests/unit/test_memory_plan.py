"""The memory plan a server makes before loading (peer/server/memory_plan.py), on the demo model's
config with the memory available and the process's RSS set by the test; and the memory available,
read from a fake cgroup."""

import asyncio
import dataclasses

import pytest
import torch

from bloompeer.blocks import open_checkpoint
from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR, write_random_checkpoint
from bloompeer.peer.server import memory_plan
from bloompeer.peer.server import server as server_module
from bloompeer.peer.server.config import ServerConfig
from bloompeer.peer.server.cache_budget import CacheBudget
from bloompeer.peer.server.memory_plan import WORKING_BYTES, MemoryPlanError, available_bytes, plan_memory
from bloompeer.peer.server.metrics import ServerMetrics
from bloompeer.peer.server.span_service import SpanService
from bloompeer.peer.server.stored_blocks import StoredBlocks
from bloompeer.weight_format import WeightFormat

MIB = 2**20
RSS = 300 * MIB


@pytest.fixture(scope="module")
def checkpoint():
    return open_checkpoint(DEMO_MODEL_DIR)


def _token_bytes(checkpoint) -> int:
    """Cache bytes of one token over one block."""
    with torch.device("meta"):
        return checkpoint.family.span_class(checkpoint.config(), 0, 1).cache_nbytes(0, 1, 1, 1, torch.float32)


@pytest.fixture
def memory(monkeypatch):
    """Set the memory available (beyond the process's RSS): memory(bytes)."""
    monkeypatch.setattr(memory_plan, "rss_bytes", lambda: RSS)

    def set_available(nbytes: int) -> None:
        monkeypatch.setattr(memory_plan, "available_bytes", lambda device: nbytes)

    return set_available


def _config(quant: str = "none", **fields) -> ServerConfig:
    return ServerConfig(model=str(DEMO_MODEL_DIR), start=None, end=None, quant=quant, **fields)


def _stored(checkpoint, quant: str = "none", group_size: int = 64) -> StoredBlocks:
    return StoredBlocks(checkpoint, WeightFormat.of(quant, group_size))


def test_blocks_are_counted_as_stored(checkpoint, memory):
    memory(10_000 * MIB)
    plans = {kind: plan_memory(_config(kind, cache_tokens=1024), checkpoint, 6) for kind in ("none", "int8", "int4")}
    none, int8, int4 = (plans[kind] for kind in ("none", "int8", "int4"))
    block = _stored(checkpoint).block_nbytes[0]
    assert none.weights_bytes == none.float_weights_bytes == int8.float_weights_bytes == 6 * block
    assert int8.weights_bytes < 0.3 * none.weights_bytes and int4.weights_bytes < 0.2 * none.weights_bytes
    assert none.copy_bytes == 0  # batched passes read the weights themselves
    assert none.fixed_bytes == RSS + WORKING_BYTES and none.available_bytes == 10_000 * MIB + RSS
    assert none.total_bytes == 6 * block + none.cache_bytes + RSS + WORKING_BYTES
    assert none.cache_bytes >= 1024 * 6 * 2 * 4 * 256  # keys and values of 6 blocks
    with torch.device("meta"):
        span = checkpoint.family.span_class(checkpoint.config(), 0, 6)
    assert CacheBudget(none.cache_bytes, span.cache_nbytes(0, 6, 1, 1, torch.float32)).tokens_left == 1024  # as asked
    assert "as int4 (groups of 64)" in str(int4) and "fixed overhead" in str(int4)


def test_int8_on_cuda_counts_the_copy_of_its_largest_layer_it_computes_from(checkpoint, memory):
    memory(10_000 * MIB)
    largest = 256 * 1024 * 2  # the demo model's MLP layer (hidden 256, 4x), in bfloat16
    on_cuda = plan_memory(_config("int8", cache_tokens=64, device="cuda:0", dtype="bfloat16"), checkpoint, 6)
    assert on_cuda.copy_bytes == largest and on_cuda.total_bytes == (
        on_cuda.weights_bytes + largest + on_cuda.cache_bytes + on_cuda.fixed_bytes)
    for device, kind in [("cpu", "int8"), ("cuda:0", "int4"), ("cuda:0", "none")]:  # from the stored weights
        assert plan_memory(_config(kind, cache_tokens=64, device=device), checkpoint, 6).copy_bytes == 0


def test_a_bare_num_blocks_serves_as_many_blocks_as_fit(checkpoint, memory):
    block = _stored(checkpoint).block_nbytes[0]
    cache = 64 * _token_bytes(checkpoint)  # 64 tokens of one block
    memory(WORKING_BYTES + 3 * block + 3 * cache + 1)
    assert plan_memory(_config(cache_tokens=64), checkpoint, None).num_blocks == 3
    assert plan_memory(_config("int8", cache_tokens=64), checkpoint, None).num_blocks == 6  # all the model has
    memory(WORKING_BYTES + 4 * block)  # the default cache: blocks take half, the cache half of the rest
    plan = plan_memory(_config(), checkpoint, None)
    assert plan.num_blocks == 2 and plan.cache_bytes == (4 * block - 2 * block) // 2


def test_blocks_of_different_sizes_are_each_counted_as_they_are(checkpoint, memory, monkeypatch):
    """A mixture of experts' dense and sparse layers differ: --blocks counts its own blocks, a count the
    largest run of that many (the server chooses where later), and 'as many as fit' the same."""
    sizes = (1 * MIB, 1 * MIB, 5 * MIB, 1 * MIB, 1 * MIB, 1 * MIB)
    monkeypatch.setattr(StoredBlocks, "block_nbytes", property(lambda self: sizes))
    memory(10_000 * MIB)
    config = _config(cache_tokens=64)
    assert plan_memory(config, checkpoint, range(3, 6)).weights_bytes == 3 * MIB
    assert plan_memory(config, checkpoint, range(1, 4)).weights_bytes == 7 * MIB
    assert plan_memory(config, checkpoint, 2).weights_bytes == 6 * MIB  # blocks 1:3 or 2:4
    cache = 64 * _token_bytes(checkpoint)
    memory(WORKING_BYTES + 6 * MIB + 2 * cache + 1)  # any 2 blocks fit, not 3 holding block 2
    assert plan_memory(config, checkpoint, None).num_blocks == 2


def test_a_plan_that_does_not_fit_is_refused_with_its_figures_and_the_flags(checkpoint, memory):
    memory(WORKING_BYTES + 2 * MIB)
    with pytest.raises(MemoryPlanError, match=r"not enough memory.*weights of 6 blocks 18\.1 MiB as float32.*--quant int8"):
        plan_memory(_config(cache_tokens=64), checkpoint, 6)
    with pytest.raises(MemoryPlanError, match="not one block fits.*--quant"):
        plan_memory(_config(cache_tokens=100_000), checkpoint, None)


def test_widths_the_kernels_cannot_take_are_refused_naming_the_flag(tiny_checkpoint, tmp_path):
    tiny = open_checkpoint(tiny_checkpoint)  # hidden 64
    for kind in ("none", "int8", "int4"):
        _stored(tiny, kind).check("cpu")
    with pytest.raises(ValueError, match="--quant int4.*groups of 128.*--quant-group-size"):
        _stored(tiny, "int4", 128).check("cpu")
    odd = open_checkpoint(write_random_checkpoint(tmp_path / "odd", num_blocks=1, hidden_size=36))
    _stored(odd, "int8").check("cpu")  # int8 takes any width


def test_a_kernel_that_fails_on_this_device_is_refused_naming_the_flag(tiny_checkpoint, monkeypatch):
    def no_kernel(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", no_kernel)
    with pytest.raises(ValueError, match="^--quant int4 does not compute on cpu: no kernel image.*--quant int8, or"):
        _stored(open_checkpoint(tiny_checkpoint), "int4").check("cpu")


def test_a_server_whose_plan_does_not_fit_refuses_before_it_touches_the_network(tiny_checkpoint, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the plan is checked before joining the network")

    monkeypatch.setattr(server_module, "join_network", no_network)
    monkeypatch.setattr(server_module.PeerNode, "create", no_network)
    config = ServerConfig(model=str(tiny_checkpoint), start=0, end=4, cache_tokens=10**10)
    with pytest.raises(MemoryPlanError, match=r"not enough memory for this server: weights of 4 blocks.*MiB available; "
                                              r"serve fewer blocks.*--quant int8.*--cache-tokens"):
        asyncio.run(server_module.Server.create(config))


HOST_AVAILABLE = 64 << 30


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """A fake cgroup (v2): cgroup(limit, usage) writes its memory.max and memory.current; on a fake
    host whose MemAvailable is HOST_AVAILABLE (the real one moves with whatever else runs)."""
    monkeypatch.setattr(memory_plan, "CGROUP_DIR", tmp_path)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {2 * HOST_AVAILABLE // 1024} kB\nMemAvailable:   {HOST_AVAILABLE // 1024} kB\n")
    monkeypatch.setattr(memory_plan, "MEMINFO_PATH", meminfo)

    def set_cgroup(limit: int | str, usage: int) -> None:
        (tmp_path / "memory.max").write_text(f"{limit}\n")
        (tmp_path / "memory.current").write_text(f"{usage}\n")

    return set_cgroup


async def test_a_containers_limit_bounds_the_cache_the_server_gives_its_sessions(checkpoint, cgroup, compute):
    """A volunteer's container on a large host: the host's MemAvailable is far above the container's
    room, and the cache the server hands out is the plan's, from that room."""
    cgroup("max", 10**9)
    assert available_bytes("cpu") == HOST_AVAILABLE  # no limit: the host's memory
    room = 300 * MIB
    cgroup(10**9 + room, 10**9)
    assert available_bytes("cpu") == room < HOST_AVAILABLE
    config = dataclasses.replace(_config(), start=0, end=6)
    plan = plan_memory(config, checkpoint, range(0, 6))
    weights = plan.weights_bytes
    assert plan.available_bytes - plan.fixed_bytes + WORKING_BYTES <= room
    assert 0 < plan.cache_bytes <= (room - WORKING_BYTES - weights) // 2  # CPU_CACHE_SHARE of what is left
    with torch.device("meta"):
        span = checkpoint.family.span_class(checkpoint.config(), 0, 6)
    service = SpanService(span, "m", config, plan.cache_bytes, compute, ServerMetrics(), accepting=lambda: True)
    try:
        assert service.budget.total_bytes == plan.cache_bytes
    finally:
        await service.stop_tasks()
    cgroup(10**9 + WORKING_BYTES + weights, 10**9)  # room for the blocks, none for a cache
    with pytest.raises(MemoryPlanError, match="not enough memory"):
        plan_memory(config, checkpoint, range(0, 6))
