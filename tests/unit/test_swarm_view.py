"""The client's view of the swarm keeps what DHT reads found until it expires: a read that comes
back partial (one block's lookup missing a server that another's found) must not drop the server.
And however many threads and tasks ask it to refresh at once, it reads the DHT once for all of them."""

import asyncio
import dataclasses
import threading

from bloompeer.p2p import FoundRecord, ServerState, get_dht_time
from bloompeer.peer.client.routing import ServerFilter
from bloompeer.peer.client.runtime import ClientRuntime
from bloompeer.peer.client.swarm import SwarmView

from .client_fakes import NUM_BLOCKS, record


class ScriptedDirectory:
    """The DHT's answers, one read after another."""

    def __init__(self, reads: list[dict[int, list[FoundRecord]]]):
        self.reads = reads

    async def find_records(self, model_uid: str, num_model_blocks: int) -> dict[int, list[FoundRecord]]:
        return self.reads.pop(0)


def _read(*items: tuple[object, float]) -> dict[int, list[FoundRecord]]:
    """{block: [FoundRecord]} for (record, expiration) pairs, each under the blocks of its span."""
    return {i: [FoundRecord(r, expires) for r, expires in items if r.start <= i < r.end] for i in range(NUM_BLOCKS)}


def _servers(view: SwarmView) -> dict[int, set[str]]:
    return {index: {r.peer_id for r in records} for index, records in view.servers.items() if records}


async def test_a_partial_read_keeps_what_earlier_reads_found_until_it_expires_or_is_replaced():
    later = get_dht_time() + 90
    a, b = record("a", 0, 2), record("b", 0, 4)
    a_offline = dataclasses.replace(a, state=ServerState.OFFLINE)
    reads = [
        _read((a, later), (b, later)),
        {0: [FoundRecord(b, later)], 2: [FoundRecord(b, later)]},  # partial: a missing, b missing at 1 and 3
        _read((a_offline, later + 30), (b, later)),  # a leaves: its newer record replaces the online one
        _read((a, later), (b, later)),  # a stale copy of a's older record, from a peer the leave did not reach
    ]
    view = SwarmView(None, ScriptedDirectory(reads), "tiny", NUM_BLOCKS, ServerFilter(None), refresh_period_s=3600.0)
    view._pinged_at = {"a": float("inf"), "b": float("inf")}  # never pinged: no network here
    await view.refresh()
    assert _servers(view) == {0: {"a", "b"}, 1: {"a", "b"}, 2: {"b"}, 3: {"b"}}
    await view.refresh()
    assert _servers(view) == {0: {"a", "b"}, 1: {"a", "b"}, 2: {"b"}, 3: {"b"}}
    await view.refresh()
    assert _servers(view) == {0: {"b"}, 1: {"b"}, 2: {"b"}, 3: {"b"}}
    assert {r.state for r in view.announced[0] if r.peer_id == "a"} == {ServerState.OFFLINE}
    await view.refresh()
    assert _servers(view) == {0: {"b"}, 1: {"b"}, 2: {"b"}, 3: {"b"}}


async def test_records_are_forgotten_once_expired():
    now = get_dht_time()
    a, b = record("a", 0, 4), record("b", 0, 4)
    reads = [_read((a, now - 1), (b, now + 90)), {}]  # a's record expires as soon as it is read
    view = SwarmView(None, ScriptedDirectory(reads), "tiny", NUM_BLOCKS, ServerFilter(None), refresh_period_s=3600.0)
    view._pinged_at = {"a": float("inf"), "b": float("inf")}
    await view.refresh()
    assert _servers(view) == {i: {"a", "b"} for i in range(NUM_BLOCKS)}
    await view.refresh()
    assert _servers(view) == {i: {"b"} for i in range(NUM_BLOCKS)}


class CountedDirectory:
    """The DHT, counting its reads; a read waits until `callers` refreshes have been asked for, so that
    each of them has had the chance to start a read of its own (up to 60 s: a guard)."""

    def __init__(self, callers: int):
        self.reads, self.callers, self.asked = 0, callers, 0

    async def find_records(self, model_uid: str, num_model_blocks: int) -> dict[int, list[FoundRecord]]:
        self.reads += 1
        for _ in range(6000):
            if self.asked >= self.callers:
                break
            await asyncio.sleep(0.01)
        return _read((record("a", 0, 4), get_dht_time() + 90))


def _counted_view(callers: int) -> SwarmView:
    view = SwarmView(None, CountedDirectory(callers), "tiny", NUM_BLOCKS, ServerFilter(None), refresh_period_s=3600.0)
    view._pinged_at = {"a": float("inf")}  # never pinged: no network here
    return view


async def _asked_to_refresh(view: SwarmView) -> None:
    view.directory.asked += 1
    await view.refresh()


def test_threads_refreshing_at_once_share_one_dht_read():
    """As an API server's request threads, each finding the view stale, do through the client's runtime."""
    threads, runtime = 8, ClientRuntime()
    view = _counted_view(threads)
    try:
        callers = [threading.Thread(target=runtime.run, args=(_asked_to_refresh(view),)) for _ in range(threads)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(120)
    finally:
        runtime.shutdown()
    assert view.directory.reads == 1
    assert _servers(view) == {i: {"a"} for i in range(NUM_BLOCKS)}


async def test_a_caller_that_stops_waiting_does_not_cancel_the_shared_refresh():
    view = _counted_view(2)
    leaving = asyncio.ensure_future(_asked_to_refresh(view))
    staying = asyncio.ensure_future(_asked_to_refresh(view))
    await asyncio.sleep(0)  # both have asked
    leaving.cancel()
    await staying
    assert view.directory.reads == 1 and _servers(view) == {i: {"a"} for i in range(NUM_BLOCKS)}
    await view.refresh()  # once done, the next refresh reads again
    assert view.directory.reads == 2
