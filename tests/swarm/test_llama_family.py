"""The Llama family through real swarms of CLI servers: tokens equal transformers' own model class
(AutoModelForCausalLM: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
on the same weights in float32, and logits within 1e-4.

Every checkpoint of LLAMA_FAMILY (tests/conftest.py) is served by two servers (blocks 0:2 and 2:4)
on the shared bootstrap peer, all started at once. The prompts run past Mistral's and Qwen2's
sliding windows (5 tokens) and past the llama3-rope model's original context (8 tokens). What needs
servers of its own (a kill, the batching check) gets a copy of the Llama checkpoint under another name.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bloompeer import AutoDistributedModelForCausalLM, DistributedLlamaForCausalLM
from bloompeer.peer.server.config import ServerConfig

from ..api.conftest import start_api
from ..conftest import LLAMA_FAMILY
from .deep_prompts import assert_prompt_gradients_equal
from .family_checks import (
    NEW_TOKENS, PROMPT, assert_eight_sessions_batched_equal_alone, assert_greedy_equal,
    assert_padded_batch_and_beam_search_equal, assert_replayed_around_a_kill, assert_speculative_equals_greedy,
    client_config, first_block_draft, started_servers,
)

ANNOUNCE_PERIOD_S = ServerConfig.announce_period_s


@pytest.fixture(scope="module")
def family_servers(swarm, llama_family_checkpoints):
    with started_servers(swarm, llama_family_checkpoints) as servers:
        yield servers


@pytest.fixture(scope="module", params=sorted(LLAMA_FAMILY))
def pair(request, family_servers, swarm, llama_family_checkpoints):
    """(our model through the swarm, transformers' model) for one checkpoint, pushing between servers
    for every other one (so that both routes are exercised across the family), and trusting only
    that model's two servers (`trusted_servers`)."""
    path = llama_family_checkpoints[request.param]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    push = sorted(LLAMA_FAMILY).index(request.param) % 2 == 1
    trusted = tuple(server.peer_id_str for server in family_servers[request.param])
    config = client_config(swarm, push=push, trusted_servers=trusted)
    with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=config) as ours:
        yield ours, reference


@torch.inference_mode()
def test_greedy_tokens_equal_transformers(pair):
    ours, reference = pair
    assert isinstance(ours, DistributedLlamaForCausalLM)
    assert_greedy_equal(ours, reference)


@torch.inference_mode()
def test_teacher_forced_logits_within_1e_4(pair):
    """A full forward (every server runs its blocks on the whole text at once) against transformers'."""
    ours, reference = pair
    ids = torch.randint(4, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)


@torch.inference_mode()
def test_left_padded_batch_and_beam_search(pair):
    assert_padded_batch_and_beam_search_equal(*pair)


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
    with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=client_config(swarm),
                                                         verify_fraction=1.0) as ours:
        yield ours, reference
        assert ours.client.swarm.bans.banned() == set()  # verification found no honest server lying


@torch.inference_mode()
@pytest.mark.parametrize("how", ["draft-model", "prompt-lookup"])
def test_speculative_decoding_rolls_back_and_equals_greedy(llama, how, rewinds):
    ours, reference = llama
    speculation = dict(assistant_model=first_block_draft(reference)) if how == "draft-model" \
        else dict(prompt_lookup_num_tokens=3)
    assert_speculative_equals_greedy(ours, reference, rewinds, **speculation)


def test_prompt_tuning_gradients_equal_local_autograd(family_servers, swarm, llama_family_checkpoints):
    path = llama_family_checkpoints["qwen3"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pre_seq_len = 3
    with DistributedLlamaForCausalLM.from_pretrained(
            path, client_config=client_config(swarm), tuning_mode="deep_ptune", pre_seq_len=pre_seq_len) as ours:
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
    assert_replayed_around_a_kill(start_servers, swarm, own_llama, reference)


@torch.inference_mode()
def test_eight_sessions_batched_on_one_server_each_equal_alone(start_servers, swarm, own_llama, llama):
    """Eight sessions of different prompt lengths through one server whose every pass waits until it
    holds a step of each (`--max-batch-sessions 8 --batch-wait`): how many steps share a pass is the
    server's rule, not the machine's speed. Each session's tokens equal transformers' alone."""
    _, reference = llama
    assert_eight_sessions_batched_equal_alone(start_servers, swarm, own_llama, reference)


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
