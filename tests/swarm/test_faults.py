"""Servers that die, hang or leave during a generation: the tokens still equal the fault-free run and HF.

Each test gets servers of its own model name (a copy of the tiny checkpoint) on the shared
bootstrap peer, so killing them never disturbs other tests.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import LogitsProcessorList

from bloompeer import MissingBlocksError

from .conftest import AtCall, seen_servers, wait_until_seen
from .conftest import swarm_client as _client

PROMPT = torch.tensor([[1, 30, 31, 32, 33]])
NEW_TOKENS = 36


def _server_of_first_span(model, servers):
    peer = model.active_session.route[0].peer_id_str
    return next(server for server in servers if server.peer_id_str == peer)


def _generate_with_fault(model, servers, fault) -> tuple[torch.Tensor, object]:
    """Generate, and at the 4th token apply `fault` to the server of the route's first span."""
    victim = []

    def act():
        victim.append(_server_of_first_span(model, servers))
        fault(victim[0])

    with torch.inference_mode():
        tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                logits_processor=LogitsProcessorList([AtCall(4, act)]))
    return tokens, victim[0]


@pytest.fixture(scope="module")
def expected(reference_model):
    with torch.inference_mode():
        return reference_model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                        do_sample=False)


@pytest.mark.parametrize("fault, push", [("SIGKILL", False), ("SIGSTOP", False), ("SIGTERM", False),
                                         ("SIGKILL", True)])
def test_generation_survives_a_server_fault(fault, push, swarm, fresh_model, start_servers, expected):
    # with push, a route of two spans (push is between servers), and a spare server for each
    servers = start_servers([(0, 2), (2, 4), (0, 2), (2, 4)] if push else [(0, 4), (0, 2), (2, 4)])
    with _client(swarm, fresh_model, push=push) as model:
        with torch.inference_mode():  # the fault-free run, through the same swarm
            fault_free = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                        do_sample=False)
        tokens, victim = _generate_with_fault(model, servers, lambda server: server.signal(getattr(signal, fault)))
    assert tokens.tolist() == fault_free.tolist() == expected.tolist()
    if fault == "SIGTERM":  # a graceful drain: the server exits by itself, cleanly, within its drain timeout
        assert victim.wait_exit(60) == 0, victim.log_tail()


def test_a_span_moved_next_to_its_own_server_is_pushed_on(swarm, fresh_model, start_servers, expected):
    """The pushed route first[0:2] -> spare[2:4] loses its first server; only the spare serves 0:2
    then, so the route becomes spare[0:2] -> spare[2:4], and the spare pushes each step on to its own
    next session (it announces itself slow, so that it is not chosen for all four blocks at once)."""
    spare = []
    starting = threading.Thread(target=lambda: spare.extend(start_servers([(0, 4)], "--throughput", "1")))
    starting.start()
    first = start_servers([(0, 2)])[0]
    starting.join()
    routes = []

    def note_route():
        routes.append([(piece.peer_id_str, piece.start, piece.end) for piece in model.active_session.route])

    def kill_first():
        note_route()
        first.signal(signal.SIGKILL)

    with _client(swarm, fresh_model, push=True, recovery_timeout_s=10.0) as model, torch.inference_mode():
        wait_until_seen(model, {first.peer_id_str: range(0, 2), spare[0].peer_id_str: range(0, 4)})
        tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                logits_processor=LogitsProcessorList([AtCall(4, kill_first),
                                                                      AtCall(NEW_TOKENS, note_route)]))
    assert routes == [[(first.peer_id_str, 0, 2), (spare[0].peer_id_str, 2, 4)],
                      [(spare[0].peer_id_str, 0, 2), (spare[0].peer_id_str, 2, 4)]]
    assert tokens.tolist() == expected.tolist()


def test_generation_waits_for_a_replacement_server(swarm, fresh_model, start_servers, expected):
    servers = start_servers([(0, 2), (2, 4)])
    starting = []

    def kill_and_replace(server):
        server.signal(signal.SIGKILL)
        starting.append(threading.Thread(target=start_servers, args=([server.blocks],)))
        starting[0].start()

    with _client(swarm, fresh_model, recovery_timeout_s=90.0) as model:
        tokens, victim = _generate_with_fault(model, servers, kill_and_replace)
    starting[0].join()
    assert victim.blocks == (0, 2)
    assert tokens.tolist() == expected.tolist()


# The client gives up after its recovery timeout (4 s here); a generation still running after this
# long hangs. A guard, never a measure of how fast the error came.
HANG_GUARD_S = 300


def test_no_replacement_is_a_clear_error_in_time(swarm, fresh_model, start_servers):
    """The client's recovery window ends the generation with an error, rather than waiting on."""
    servers = start_servers([(0, 2), (2, 4)])
    generating = ThreadPoolExecutor(1)  # outside the client: closing the client ends a hung generation
    try:
        with _client(swarm, fresh_model, recovery_timeout_s=4.0) as model:
            failing = generating.submit(_generate_with_fault, model, servers,
                                        lambda server: server.signal(signal.SIGKILL))
            with pytest.raises(MissingBlocksError, match=r"block\(s\) 0:2 of " + fresh_model.name):
                failing.result(timeout=HANG_GUARD_S)
    finally:
        generating.shutdown()


def test_num_blocks_fills_the_model_before_doubling_up(swarm, fresh_model, start_servers):
    first = start_servers([(None, None)], "--num-blocks", "2")[0]
    second = start_servers([(None, None)], "--num-blocks", "2")[0]
    assert {first.blocks, second.blocks} == {(0, 2), (2, 4)}
    third = start_servers([(None, None)], "--num-blocks", "3")[0]
    assert third.blocks in {(0, 3), (1, 4)}


def test_routing_prefers_the_faster_of_two_servers(swarm, fresh_model, start_servers):
    """One server is really slowed down (stopped 98% of the time, for half a second at a time: far slower
    than any server on a loaded machine, well within the ping timeout); the client measures and avoids it."""
    servers = start_servers([(0, 4), (0, 4)])
    for slow, fast in [(servers[0], servers[1]), (servers[1], servers[0])]:
        stop_slowing = threading.Event()
        slowing = threading.Thread(target=_throttle, args=(slow, stop_slowing))
        slowing.start()
        try:
            with _client(swarm, fresh_model) as model:
                view = model.client.swarm
                wait_until_seen(model, {slow.peer_id_str: range(0, 4), fast.peer_id_str: range(0, 4)})
                with model.inference_session(max_length=8) as session, torch.inference_mode():
                    model(PROMPT)
                    route = [piece.peer_id_str for piece in session.route]
                assert route == [fast.peer_id_str], (
                    f"routed through the slowed server {slow.peer_id_str}; the client measured {view.rtts_s} "
                    f"and saw servers {seen_servers(model)}")
        finally:
            stop_slowing.set()
            slowing.join()


def _throttle(server, stop: threading.Event) -> None:
    while not stop.is_set():
        server.signal(signal.SIGSTOP)
        time.sleep(0.49)
        server.signal(signal.SIGCONT)
        time.sleep(0.01)
