"""Servers that lie, or serve other weights under the same name: the client catches them and the
tokens stay those of HF."""

import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch

from bloompeer.peer.client.health import MISBEHAVIOR_BAN_S

from .conftest import swarm_client, wait_until_seen

LIAR = [sys.executable, str(Path(__file__).parent.parent / "helpers" / "lying_server.py")]
FAST = ("--throughput", "1e6")  # announced as very fast, so routing prefers it ...
SLOW = ("--throughput", "1")  # ... to honest servers announced as slow (not by a few ms of ping noise)
PROMPT = torch.tensor([[1, 40, 41, 42]])


def _generate(model, tokens=12):
    with torch.inference_mode():
        return model.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)


def _expected(reference_model, tokens=12):
    with torch.inference_mode():
        return reference_model.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)


def test_a_lying_server_is_caught_by_a_second_server_and_routed_around(swarm, fresh_model, start_servers,
                                                                      reference_model, caplog):
    liar = start_servers([(0, 4)], *FAST, program=LIAR)[0]
    honest = start_servers([(0, 4), (0, 4)], *SLOW)
    with caplog.at_level(logging.WARNING), swarm_client(swarm, fresh_model, verify_fraction=1.0) as model:
        _seeing(model, liar, *honest)
        tokens = _generate(model)
        assert liar.peer_id_str in model.client.swarm.bans.banned(), _view(model)
    assert tokens.tolist() == _expected(reference_model).tolist()
    assert any(liar.peer_id_str in r.message and "relative error" in r.message for r in caplog.records)


def _blamed(model) -> set[str]:
    """The servers banned as liars (for an hour), not those banned briefly for a slow answer."""
    now = time.monotonic()
    return {peer for peer, until in model.client.swarm.bans._until.items() if until - now > MISBEHAVIOR_BAN_S - 60}


def _view(model) -> str:
    """What the client knew of the swarm, for a failed verdict's message: who serves which blocks,
    their round trips, and who is banned for how much longer."""
    swarm, now = model.client.swarm, time.monotonic()
    serving = {block: sorted(record.peer_id for record in records) for block, records in swarm.servers.items()}
    bans = {peer: round(until - now) for peer, until in swarm.bans._until.items()}
    return f"servers by block {serving}; round trips {swarm.rtts_s}; bans (s left) {bans}"


def _seeing(model, *servers, blocks=range(4)):
    """Wait until the client sees each of `servers` for `blocks` (conftest.wait_until_seen): a liar it
    has not seen yet is neither routed through nor asked to check, so it cannot be caught."""
    wait_until_seen(model, {server.peer_id_str: blocks for server in servers})


def test_a_lie_is_caught_in_a_session_with_deep_prompts(swarm, fresh_model, start_servers):
    """The check recomputes the span with the session's deep prompts: the liar is caught at the
    first (prompted) step, and the honest servers, agreeing with each other, are not blamed."""
    liar = start_servers([(0, 4)], *FAST, program=LIAR)[0]
    honest = start_servers([(0, 4), (0, 4)], *SLOW)
    # a generous timeout: an honest server slow to answer on a loaded machine is banned briefly, which is not blame
    with swarm_client(swarm, fresh_model, verify_fraction=1.0, tuning_mode="deep_ptune", pre_seq_len=2,
                      request_timeout_s=30.0) as model:
        with torch.no_grad():
            model.transformer.intermediate_prompt_embeddings.weight.normal_(std=0.5)
        _seeing(model, liar, *honest)
        tokens = _generate(model)
        assert _blamed(model) == {liar.peer_id_str}, _view(model)
        assert _generate(model).tolist() == tokens.tolist()  # again, with the liar banned from the start


def test_a_bfloat16_server_is_checked_only_against_bfloat16_arithmetic(swarm, fresh_model, start_servers):
    """bfloat16 and float32 outputs differ by about a lie's size (ServerRecord.arithmetic): a lying
    bfloat16 server is caught against the client's own blocks in bfloat16, and neither the honest
    bfloat16 server nor the float32 one is blamed for differing from each other."""
    bfloat16 = ("--dtype", "bfloat16")
    liar = start_servers([(0, 4)], *FAST, *bfloat16, program=LIAR)[0]
    honest = start_servers([(0, 4)], *SLOW, *bfloat16) + start_servers([(0, 4)], *SLOW)
    with swarm_client(swarm, fresh_model, verify_fraction=1.0, request_timeout_s=30.0) as model:
        _seeing(model, liar, *honest)
        _generate(model)
        assert _blamed(model) == {liar.peer_id_str}, _view(model)


def test_without_verification_the_lie_goes_through(swarm, fresh_model, start_servers, reference_model):
    """The control experiment: unchecked, the liar's outputs reach the client."""
    liar = start_servers([(0, 4)], *FAST, program=LIAR)[0]
    honest = start_servers([(0, 4)], *SLOW)[0]
    with swarm_client(swarm, fresh_model) as model, torch.inference_mode():
        _seeing(model, liar, honest)  # the choice is tested
        difference = (model(PROMPT).logits - reference_model(PROMPT).logits).abs().max()
    assert difference > 1e-2


def test_the_client_checks_a_lone_server_against_its_own_copy_of_the_blocks(swarm, fresh_model, start_servers,
                                                                           reference_model):
    """No second server holds all of 0:2, so the client recomputes those blocks from its checkpoint."""
    liar = start_servers([(0, 2)], *FAST, program=LIAR)[0]
    start_servers([(0, 1), (1, 2), (2, 4)], *SLOW)
    with swarm_client(swarm, fresh_model, verify_fraction=1.0) as model:
        _seeing(model, liar, blocks=range(2))
        tokens = _generate(model)
        assert liar.peer_id_str in model.client.swarm.bans.banned(), _view(model)
    assert tokens.tolist() == _expected(reference_model).tolist()


def test_trusted_servers_only(swarm, fresh_model, start_servers, reference_model):
    start_servers([(0, 4)], *FAST, program=LIAR)
    honest = start_servers([(0, 4)])[0]
    with swarm_client(swarm, fresh_model, trusted_servers=(honest.peer_id_str,)) as model:
        tokens = _generate(model)
    assert tokens.tolist() == _expected(reference_model).tolist()


def test_servers_of_other_weights_under_the_same_name_are_refused(swarm, fresh_model, start_servers,
                                                                 reference_model, tmp_path):
    impostor = tmp_path / "impostor" / fresh_model.name  # same model name, another config
    shutil.copytree(fresh_model, impostor)
    config = json.loads((impostor / "config.json").read_text())
    (impostor / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 2e-5}))
    start_servers([(0, 4)], *FAST, model=impostor)
    honest = start_servers([(0, 4)])[0]
    with swarm_client(swarm, fresh_model) as model, model.inference_session(max_length=32) as session:
        with torch.inference_mode():
            model(PROMPT)
        assert [piece.peer_id_str for piece in session.route] == [honest.peer_id_str]
