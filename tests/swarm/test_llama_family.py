"""The Llama family through real swarms of CLI servers: tokens equal transformers' own model class
(AutoModelForCausalLM: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
on the same weights in float32, and logits within 1e-4.

Every checkpoint of LLAMA_FAMILY (tests/conftest.py) is served by two servers (blocks 0:2 and 2:4)
on the shared bootstrap peer, all started at once. The prompts run past Mistral's and Qwen2's
sliding windows (5 tokens) and past the llama3-rope model's original context (8 tokens). What needs
servers of its own (a kill, the batching check) gets a copy of the Llama checkpoint under another name.
"""

from __future__ import annotations

import copy
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from bloompeer import (AutoDistributedModelForCausalLM, ClientConfig, DistributedLlamaForCausalLM, NetworkConfig)
from bloompeer.peer.cli.local_swarm import stop_in_parallel
from bloompeer.peer.server.config import ServerConfig

from ..api.conftest import start_api
from ..conftest import LLAMA_FAMILY
from .conftest import AtCall
from .deep_prompts import assert_prompt_gradients_equal
from .test_server_metrics import scrape, value

PROMPT = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]])  # 11 tokens: past every window and context
PADDED = torch.tensor([[0, 0, 0, 50, 51, 52, 53, 54, 55], [60, 61, 62, 63, 64, 65, 66, 67, 68]])
PADDED_MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])
NEW_TOKENS = 14
ANNOUNCE_PERIOD_S = ServerConfig.announce_period_s


def _client_config(swarm, **settings) -> ClientConfig:
    network = NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True)
    return ClientConfig(network, **({"request_timeout_s": 3.0, "swarm_refresh_period_s": 1.0,
                                     "poll_period_s": 0.5} | settings))


@pytest.fixture(scope="module")
def family_servers(swarm, llama_family_checkpoints):
    servers = [swarm.add_server(start, end, model=path, wait=False, name=f"{name}-{start}-{end}")
               for name, path in llama_family_checkpoints.items() for start, end in [(0, 2), (2, 4)]]
    try:
        deadline = time.monotonic() + 180
        for server in servers:
            server.wait_online(deadline)
        yield servers
    finally:
        stop_in_parallel(servers)


@pytest.fixture(scope="module", params=sorted(LLAMA_FAMILY))
def pair(request, family_servers, swarm, llama_family_checkpoints):
    """(our model through the swarm, transformers' model) for one checkpoint, pushing between servers
    for every other one (so that both routes are exercised across the family), and trusting only
    that model's two servers (`trusted_servers`)."""
    path = llama_family_checkpoints[request.param]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    push = sorted(LLAMA_FAMILY).index(request.param) % 2 == 1
    trusted = tuple(server.peer_id_str for server in family_servers if server.name.startswith(request.param + "-"))
    assert len(trusted) == 2
    config = _client_config(swarm, push=push, trusted_servers=trusted)
    with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=config) as ours:
        yield ours, reference


@torch.inference_mode()
def test_greedy_tokens_equal_transformers(pair):
    ours, reference = pair
    assert isinstance(ours, DistributedLlamaForCausalLM)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    assert ours.generate(PROMPT, **kwargs).tolist() == reference.generate(PROMPT, **kwargs).tolist()


@torch.inference_mode()
def test_teacher_forced_logits_within_1e_4(pair):
    """A full forward (every server runs its blocks on the whole text at once) against transformers'."""
    ours, reference = pair
    ids = torch.randint(4, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)


@torch.inference_mode()
def test_left_padded_batch_and_beam_search(pair):
    ours, reference = pair
    greedy = dict(attention_mask=PADDED_MASK, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert ours.generate(PADDED, **greedy).tolist() == reference.generate(PADDED, **greedy).tolist()
    beams = greedy | dict(num_beams=3)
    assert ours.generate(PADDED, **beams).tolist() == reference.generate(PADDED, **beams).tolist()


@torch.inference_mode()
def test_sampling_with_the_same_seed(pair):
    ours, reference = pair
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_k=20)
    torch.manual_seed(5)
    mine = ours.generate(PROMPT, **kwargs)
    torch.manual_seed(5)
    assert mine.tolist() == reference.generate(PROMPT, **kwargs).tolist()


@pytest.fixture(scope="module")
def llama(family_servers, swarm, llama_family_checkpoints):
    """The Llama checkpoint's client, checking every step of its servers against its own copy of the blocks."""
    path = llama_family_checkpoints["llama"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=_client_config(swarm),
                                                         verify_fraction=1.0) as ours:
        yield ours, reference
        assert ours.client.swarm.bans.banned() == set()  # verification found no honest server lying


@pytest.fixture
def rewinds(monkeypatch) -> list[int]:
    """Every position a session's cache was rolled back to during the test."""
    from bloompeer.peer.client.inference_session import InferenceSession

    seen, rewind = [], InferenceSession.rewind

    def recording(session, position):
        if position < session.position:
            seen.append(position)
        return rewind(session, position)

    monkeypatch.setattr(InferenceSession, "rewind", recording)
    return seen


@torch.inference_mode()
@pytest.mark.parametrize("how", ["draft-model", "prompt-lookup"])
def test_speculative_decoding_rolls_back_and_equals_greedy(llama, how, rewinds):
    ours, reference = llama
    if how == "draft-model":  # the target's first block alone: it agrees with the target on some tokens only
        draft = copy.deepcopy(reference)
        draft.model.layers = draft.model.layers[:1]
        draft.config.num_hidden_layers = 1
        speculation = dict(assistant_model=draft)
    else:
        speculation = dict(prompt_lookup_num_tokens=3)
    prompt = torch.cat([PROMPT, PROMPT[:, 1:]], dim=1)  # repeats itself, so prompt lookup has proposals
    expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = ours.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **speculation)
    assert tokens.tolist() == expected.tolist()
    assert rewinds, "no proposal was rejected: the servers' caches never rolled back"


def test_prompt_tuning_gradients_equal_local_autograd(family_servers, swarm, llama_family_checkpoints):
    path = llama_family_checkpoints["qwen3"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pre_seq_len = 3
    with DistributedLlamaForCausalLM.from_pretrained(
            path, client_config=_client_config(swarm), tuning_mode="deep_ptune", pre_seq_len=pre_seq_len) as ours:
        assert_prompt_gradients_equal(ours, reference)


@pytest.fixture
def own_llama(llama_family_checkpoints, tmp_path):
    """A copy of the Llama checkpoint under a name of its own, so its servers serve no other test."""
    path = tmp_path / f"llama-{time.monotonic_ns() % 10**8}"
    shutil.copytree(llama_family_checkpoints["llama"], path)
    return path


@torch.inference_mode()
def test_a_server_killed_mid_generation_is_replayed_around(start_servers, swarm, own_llama, llama):
    _, reference = llama
    servers = start_servers([(0, 2), (2, 4), (0, 2), (2, 4)], model=own_llama)
    expected = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    victims = []

    def kill_the_first_span():
        peer = ours.active_session.route[0].peer_id_str
        victims.append(next(server for server in servers if server.peer_id_str == peer))
        victims[0].signal(signal.SIGKILL)

    with AutoDistributedModelForCausalLM.from_pretrained(own_llama, client_config=_client_config(swarm)) as ours:
        tokens = ours.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               logits_processor=LogitsProcessorList([AtCall(4, kill_the_first_span)]))
    assert victims and victims[0].process.wait(timeout=30) != 0
    assert tokens.tolist() == expected.tolist()


# A batch wait far beyond a round of eight sessions' steps on a loaded machine: a guard, as a pass
# runs as soon as it holds the eight steps; and the client's step timeout beyond that again
BATCH_WAIT_S = 120
SESSIONS = 8


@torch.inference_mode()
def test_eight_sessions_batched_on_one_server_each_equal_alone(start_servers, swarm, own_llama, llama):
    """Eight sessions of different prompt lengths through one server whose every pass waits until it
    holds a step of each (`--max-batch-sessions 8 --batch-wait`): how many steps share a pass is the
    server's rule, not the machine's speed. Each session's tokens equal transformers' alone."""
    _, reference = llama
    (server,) = start_servers([(0, 4)], "--metrics-port", "0", "--max-batch-sessions", str(SESSIONS),
                              "--batch-wait", str(BATCH_WAIT_S), model=own_llama)
    url = next(line for line in server.stdout if line.startswith("metrics: ")).split(" ", 1)[1]
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(4, 250, (1, 4 + i), generator=generator) for i in range(SESSIONS)]
    # every session takes as many steps (no end-of-sequence token before NEW_TOKENS): their steps
    # keep coming in rounds of eight, to the last
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = [reference.generate(p, **kwargs).tolist() for p in prompts]
    before = scrape(url)
    config = _client_config(swarm, request_timeout_s=2.0 * BATCH_WAIT_S)
    with AutoDistributedModelForCausalLM.from_pretrained(own_llama, client_config=config) as ours:
        with ThreadPoolExecutor(SESSIONS) as pool:
            together = list(pool.map(lambda prompt: ours.generate(prompt, **kwargs).tolist(), prompts))
    after = scrape(url)
    assert together == expected
    passes = value(after, "bloompeer_server_batch_size_count") - value(before, "bloompeer_server_batch_size_count")
    requests = value(after, "bloompeer_server_batch_size_sum") - value(before, "bloompeer_server_batch_size_sum")
    assert passes >= NEW_TOKENS and requests == SESSIONS * passes, (
        f"{requests:.0f} requests in {passes:.0f} passes: not every pass held a step of each of the {SESSIONS} "
        f"sessions")


@torch.inference_mode()
def test_the_api_serves_the_family_with_the_checkpoints_chat_template(family_servers, swarm,
                                                                       llama_family_checkpoints, tmp_path):
    path = llama_family_checkpoints["qwen3"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = torch.tensor([tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"]])
    assert tokenizer.decode(ids[0]).startswith("<|system|>Be brief.")  # the checkpoint's own template
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                  do_sample=False)[0, ids.shape[1]:]
    api = start_api(path, tmp_path, "--initial-peers", *swarm.initial_peers)
    try:
        with api.client() as client:
            models = client.models.list().data
            response = client.chat.completions.create(model=path.name, messages=messages, max_tokens=8,
                                                      temperature=0)
            prompts = [ids[0].tolist(), ids[0, :5].tolist()]  # prompt scoring: one pass, padded, as for BLOOM
            scored = client.completions.create(model=path.name, prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    finally:
        api.stop()
    assert [m.id for m in models] == [path.name]
    assert response.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    for prompt, choice in zip(prompts, scored.choices):
        logprobs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
        wanted = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(wanted, abs=1e-4)


def test_status_shows_the_family_from_the_records(family_servers, swarm, llama_family_checkpoints):
    import json
    import subprocess
    import sys

    path = llama_family_checkpoints["mistral"]
    # servers that joined at the same moment store their first records where their young routing
    # tables point; a lookup may miss one until a later store (seconds after joining) has placed it
    # better: ask until then, or at most an announce period
    deadline = time.monotonic() + ANNOUNCE_PERIOD_S
    while True:
        result = subprocess.run([sys.executable, "-m", "bloompeer", "status", "--model", str(path), "--json",
                                 "--initial-peers", *swarm.initial_peers], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)
        if not status["missing"] or time.monotonic() > deadline:
            break
    assert status["missing"] == [] and status["num_blocks"] == 4
    assert {server["family"] for block in status["blocks"] for server in block["servers"]} == {"llama"}
