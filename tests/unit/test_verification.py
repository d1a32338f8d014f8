"""Verification's verdicts (peer/client/verification.py), with the second opinions given by the test:
on a dense span one disagreement bans a server; on a routed span (a mixture of experts' blocks, where an
honest recomputation can send a token to another expert) it takes 2 of a server's last 3 checks."""

from types import SimpleNamespace

import torch

from bloompeer.p2p import RequestLimits, ServerRecord, ServerState
from bloompeer.peer.client.config import ClientConfig
from bloompeer.peer.client.health import BanList
from bloompeer.peer.client.routing import SpanRoute
from bloompeer.peer.client.verification import OutputVerifier
from bloompeer.weight_format import WeightFormat

SERVER = "QmServer"
OUTPUT = torch.ones(1, 1, 8)
AGREEING, DISAGREEING = OUTPUT.clone(), OUTPUT * 1.5  # 50 % off: a lie's size, or a token sent elsewhere


def _verifier(routed_blocks=()) -> OutputVerifier:
    record = ServerRecord(SERVER, ServerState.ONLINE, 0, 2, 1.0, 100, WeightFormat(), "0", "f", False,
                          RequestLimits(1, 1, 1))
    swarm = SimpleNamespace(servers={0: [record]}, bans=BanList(), rtts_s={})
    return OutputVerifier(None, swarm, ClientConfig(verify_fraction=1.0), None, routed_blocks)


async def _check(verifier: OutputVerifier, checked: torch.Tensor) -> set[str]:
    async def opinion(*args):  # the client's own recomputation, and no third opinion
        exclude = args[-1]
        return None if "local" in exclude else ("local", checked)

    verifier._opinion = opinion
    return await verifier.find_liars(SpanRoute(SERVER, 0, 2), torch.zeros(1, 3, 8), None, OUTPUT)


async def test_on_a_dense_span_one_disagreement_bans_the_server():
    verifier = _verifier()
    assert SERVER in await _check(verifier, DISAGREEING)
    assert SERVER in verifier.swarm.bans.banned()


async def test_on_a_routed_span_a_server_is_wrong_after_two_of_its_last_three_checks():
    verifier = _verifier(routed_blocks=[1])
    assert SERVER not in await _check(verifier, DISAGREEING)  # an honest token may have gone elsewhere
    assert await _check(verifier, AGREEING) == set()
    assert SERVER not in verifier.swarm.bans.banned()
    assert SERVER in await _check(verifier, DISAGREEING)  # 2 of 3: a liar disagrees on every check
    assert SERVER in verifier.swarm.bans.banned()


async def test_on_a_routed_span_disagreements_far_apart_never_ban():
    verifier = _verifier(routed_blocks=[0])
    for _ in range(4):
        assert SERVER not in await _check(verifier, DISAGREEING)
        assert await _check(verifier, AGREEING) == set()
        assert await _check(verifier, AGREEING) == set()
    assert SERVER not in verifier.swarm.bans.banned()
