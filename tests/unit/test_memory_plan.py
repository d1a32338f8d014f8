"""The memory plan a server makes before loading (peer/server/memory_plan.py), on the demo model's
config with the memory available and the process's RSS set by the test."""

import asyncio

import pytest
import torch

from bloompeer.blocks import open_checkpoint
from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR, write_random_checkpoint
from bloompeer.peer.server import memory_plan
from bloompeer.peer.server import server as server_module
from bloompeer.peer.server.config import ServerConfig
from bloompeer.peer.server.memory_plan import WORKING_BYTES, MemoryPlanError, plan_memory
from bloompeer.peer.server.quantization import WeightStorage

MIB = 2**20
RSS = 300 * MIB


@pytest.fixture(scope="module")
def checkpoint():
    return open_checkpoint(DEMO_MODEL_DIR)


def _token_bytes(checkpoint) -> int:
    """Cache bytes of one token over one block."""
    with torch.device("meta"):
        return checkpoint.family.span_class(checkpoint.config(), 0, 1).cache_nbytes(1, 1, 1, torch.float32)


@pytest.fixture
def memory(monkeypatch):
    """Set the memory available (beyond the process's RSS): memory(bytes)."""
    monkeypatch.setattr(memory_plan, "rss_bytes", lambda: RSS)

    def set_available(nbytes: int) -> None:
        monkeypatch.setattr(memory_plan, "available_bytes", lambda device: nbytes)

    return set_available


def _config(**fields) -> ServerConfig:
    return ServerConfig(model=str(DEMO_MODEL_DIR), start=None, end=None, **fields)


def test_blocks_are_counted_as_stored(checkpoint, memory):
    memory(10_000 * MIB)
    plans = {kind: plan_memory(_config(cache_tokens=1024), checkpoint, 6, WeightStorage(kind, 64))
             for kind in ("none", "int8", "int4")}
    none, int8, int4 = (plans[kind] for kind in ("none", "int8", "int4"))
    assert none.block_bytes == none.float_block_bytes == int8.float_block_bytes
    assert int8.block_bytes < 0.3 * none.block_bytes and int4.block_bytes < 0.2 * none.block_bytes
    assert none.copy_bytes == 0  # batched passes read the weights themselves
    assert none.fixed_bytes == RSS + WORKING_BYTES and none.available_bytes == 10_000 * MIB + RSS
    assert none.total_bytes == 6 * none.block_bytes + none.cache_bytes + RSS + WORKING_BYTES
    assert none.cache_bytes == 1024 * 6 * _token_bytes(checkpoint) >= 1024 * 6 * 2 * 4 * 256  # keys, values: 6 blocks
    assert "as int4 (groups of 64)" in str(int4) and "fixed overhead" in str(int4)


def test_int8_on_cuda_counts_the_copy_of_its_largest_layer_it_computes_from(checkpoint, memory):
    memory(10_000 * MIB)
    largest = 256 * 1024 * 2  # the demo model's MLP layer (hidden 256, 4x), in bfloat16
    on_cuda = plan_memory(_config(cache_tokens=64, device="cuda:0", dtype="bfloat16"), checkpoint, 6,
                          WeightStorage("int8", 64))
    assert on_cuda.copy_bytes == largest and on_cuda.total_bytes == (
        6 * on_cuda.block_bytes + largest + on_cuda.cache_bytes + on_cuda.fixed_bytes)
    for device, kind in [("cpu", "int8"), ("cuda:0", "int4"), ("cuda:0", "none")]:  # from the stored weights
        plan = plan_memory(_config(cache_tokens=64, device=device), checkpoint, 6, WeightStorage(kind, 64))
        assert plan.copy_bytes == 0


def test_a_bare_num_blocks_serves_as_many_blocks_as_fit(checkpoint, memory):
    none, int8 = WeightStorage("none", 64), WeightStorage("int8", 64)
    block = none.block_nbytes(checkpoint, torch.float32)
    cache = 64 * _token_bytes(checkpoint)  # 64 tokens of one block
    memory(WORKING_BYTES + 3 * block + 3 * cache + 1)
    assert plan_memory(_config(cache_tokens=64), checkpoint, None, none).num_blocks == 3
    assert plan_memory(_config(cache_tokens=64), checkpoint, None, int8).num_blocks == 6  # all the model has
    memory(WORKING_BYTES + 4 * block)  # the default cache: blocks take half, the cache half of the rest
    plan = plan_memory(_config(), checkpoint, None, none)
    assert plan.num_blocks == 2 and plan.cache_bytes == (4 * block - 2 * block) // 2


def test_a_plan_that_does_not_fit_is_refused_with_its_figures_and_the_flags(checkpoint, memory):
    memory(WORKING_BYTES + 2 * MIB)
    with pytest.raises(MemoryPlanError, match=r"not enough memory.*weights 6 blocks x 3\.0 MiB.*--quant int8"):
        plan_memory(_config(cache_tokens=64), checkpoint, 6, WeightStorage("none", 64))
    with pytest.raises(MemoryPlanError, match="not one block fits.*--quant"):
        plan_memory(_config(cache_tokens=100_000), checkpoint, None, WeightStorage("none", 64))


def test_widths_the_kernels_cannot_take_are_refused_naming_the_flag(tiny_checkpoint, tmp_path):
    tiny = open_checkpoint(tiny_checkpoint)  # hidden 64
    for kind in ("none", "int8", "int4"):
        WeightStorage(kind, 64).check(tiny, "cpu")
    with pytest.raises(ValueError, match="--quant int4.*groups of 128.*--quant-group-size"):
        WeightStorage("int4", 128).check(tiny, "cpu")
    odd = open_checkpoint(write_random_checkpoint(tmp_path / "odd", num_blocks=1, hidden_size=36))
    WeightStorage("int8", 64).check(odd, "cpu")  # int8 takes any width


def test_a_kernel_that_fails_on_this_device_is_refused_naming_the_flag(tiny_checkpoint, monkeypatch):
    def no_kernel(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", no_kernel)
    with pytest.raises(ValueError, match="^--quant int4 does not compute on cpu: no kernel image.*--quant int8, or"):
        WeightStorage("int4", 64).check(open_checkpoint(tiny_checkpoint), "cpu")


def test_a_server_whose_plan_does_not_fit_refuses_before_it_touches_the_network(tiny_checkpoint, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the plan is checked before joining the network")

    monkeypatch.setattr(server_module, "join_network", no_network)
    monkeypatch.setattr(server_module.PeerNode, "create", no_network)
    config = ServerConfig(model=str(tiny_checkpoint), start=0, end=4, cache_tokens=10**10)
    with pytest.raises(MemoryPlanError, match=r"not enough memory for this server: weights 4 blocks.*MiB available; "
                                              r"serve fewer blocks.*--quant int8.*--cache-tokens"):
        asyncio.run(server_module.Server.create(config))
