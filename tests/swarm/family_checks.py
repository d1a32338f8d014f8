"""The exactness checks that every model family's swarm tests make, written once: functions of our model
through the swarm and transformers' model on the same weights (or of the swarm and a checkpoint, for the
checks that need servers of their own). test_llama_family.py, test_moe_family.py and test_deepseek_family.py
call them for their checkpoints, each module with its servers started once and shared by its tests
(`started_servers`), so that a family's checks cost no more than its servers and its tokens."""

from __future__ import annotations

import contextlib
import copy
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from bloompeer import AutoDistributedModelForCausalLM, ClientConfig, NetworkConfig
from bloompeer.peer.cli.local_swarm import stop_in_parallel

from .conftest import AtCall
from .test_server_metrics import scrape, value

__all__ = [
    "BATCH_WAIT_S", "NEW_TOKENS", "PADDED", "PADDED_MASK", "PROMPT", "SESSIONS",
    "assert_concurrent_sessions_equal_alone", "assert_eight_sessions_batched_equal_alone", "assert_greedy_equal", "assert_padded_batch_and_beam_search_equal",
    "assert_replayed_around_a_kill", "assert_speculative_equals_greedy", "client_config", "first_block_draft",
    "session_prompts", "started_servers",
]

PROMPT = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]])  # 11 tokens: past every window and context
PADDED = torch.tensor([[0, 0, 0, 50, 51, 52, 53, 54, 55], [60, 61, 62, 63, 64, 65, 66, 67, 68]])
PADDED_MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])
NEW_TOKENS = 14
# A batch wait far beyond a round of eight sessions' steps on a loaded machine: a guard, as a pass
# runs as soon as it holds the eight steps; and the client's step timeout beyond that again
BATCH_WAIT_S = 120
SESSIONS = 8


def client_config(swarm, **settings) -> ClientConfig:
    """A client of the shared swarm with short timeouts, so that faults show quickly."""
    network = NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True)
    return ClientConfig(network, **({"request_timeout_s": 3.0, "swarm_refresh_period_s": 1.0,
                                     "poll_period_s": 0.5} | settings))


@contextlib.contextmanager
def started_servers(swarm, checkpoints: dict[str, Path], spans: dict[str, list[tuple[int, int]]] | None = None
                    ) -> Iterator[dict[str, list]]:
    """name -> the servers of checkpoints[name] (by default two, blocks 0:2 and 2:4; `spans` may say otherwise
    per name), named "{name}-{start}-{end}", all started at once on the shared bootstrap peer; stopped
    together after."""
    spans = spans or {}
    servers = {name: [swarm.add_server(start, end, model=path, wait=False, name=f"{name}-{start}-{end}")
                      for start, end in spans.get(name, [(0, 2), (2, 4)])] for name, path in checkpoints.items()}
    every = [server for pair in servers.values() for server in pair]
    try:
        deadline = time.monotonic() + 180
        for server in every:
            server.wait_online(deadline)
        yield servers
    finally:
        stop_in_parallel(every)


def assert_greedy_equal(ours, reference, **settings) -> None:
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False) | settings
    assert ours.generate(PROMPT, **kwargs).tolist() == reference.generate(PROMPT, **kwargs).tolist()


def assert_padded_batch_and_beam_search_equal(ours, reference) -> None:
    """A left-padded batch, greedy and with 3 beams (which reorder the servers' caches as transformers'
    reorders its own)."""
    greedy = dict(attention_mask=PADDED_MASK, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert ours.generate(PADDED, **greedy).tolist() == reference.generate(PADDED, **greedy).tolist()
    beams = greedy | dict(num_beams=3)
    assert ours.generate(PADDED, **beams).tolist() == reference.generate(PADDED, **beams).tolist()


def first_block_draft(reference):
    """The target's first block alone, as a draft model: it agrees with the target on some tokens only."""
    draft = copy.deepcopy(reference)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    return draft


def assert_speculative_equals_greedy(ours, reference, rewinds: list[int], **speculation) -> None:
    """Generation with `speculation` (assistant_model=..., prompt_lookup_num_tokens=...) on a prompt that
    repeats itself (so that prompt lookup has proposals) equals transformers' plain greedy, and some proposal
    was rejected (`rewinds`: the conftest fixture), so the servers' caches were rolled back."""
    prompt = torch.cat([PROMPT, PROMPT[:, 1:]], dim=1)
    expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = ours.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **speculation)
    assert tokens.tolist() == expected.tolist()
    assert rewinds, "no proposal was rejected: the servers' caches never rolled back"


def assert_replayed_around_a_kill(start_servers, swarm, path, reference) -> None:
    """Two servers for each half of `path`'s 4 blocks; the first span's server of the session is killed
    at the 4th token, and the tokens still equal transformers'."""
    servers = start_servers([(0, 2), (2, 4), (0, 2), (2, 4)], model=path)
    expected = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    victims = []

    def kill_the_first_span():
        peer = ours.active_session.route[0].peer_id_str
        victims.append(next(server for server in servers if server.peer_id_str == peer))
        victims[0].signal(signal.SIGKILL)

    with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=client_config(swarm)) as ours:
        tokens = ours.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               logits_processor=LogitsProcessorList([AtCall(4, kill_the_first_span)]))
    assert victims and victims[0].process.wait(timeout=30) != 0
    assert tokens.tolist() == expected.tolist()


def session_prompts() -> list[torch.Tensor]:
    """SESSIONS prompts of different lengths (4 to 11 tokens)."""
    generator = torch.Generator().manual_seed(8)
    return [torch.randint(4, 250, (1, 4 + i), generator=generator) for i in range(SESSIONS)]


def assert_concurrent_sessions_equal_alone(ours, reference) -> None:
    """SESSIONS sessions at once through `ours`: however the servers batch their steps (that is the machine's
    speed), each session's tokens equal transformers' alone."""
    prompts = session_prompts()
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = [reference.generate(prompt, **kwargs).tolist() for prompt in prompts]
    with ThreadPoolExecutor(SESSIONS) as pool:
        together = list(pool.map(lambda prompt: ours.generate(prompt, **kwargs).tolist(), prompts))
    assert together == expected


def assert_eight_sessions_batched_equal_alone(start_servers, swarm, path, reference) -> None:
    """Eight sessions of `path` through one server of its 4 blocks whose every pass waits until it holds a step
    of each (`--max-batch-sessions 8 --batch-wait`): how many steps share a pass is the server's rule, not the
    machine's speed. Each session's tokens equal transformers' alone."""
    (server,) = start_servers([(0, 4)], "--metrics-port", "0", "--max-batch-sessions", str(SESSIONS),
                              "--batch-wait", str(BATCH_WAIT_S), model=path)
    url = next(line for line in server.stdout if line.startswith("metrics: ")).split(" ", 1)[1]
    prompts = session_prompts()
    # every session takes as many steps (no end-of-sequence token before NEW_TOKENS): their steps
    # keep coming in rounds of eight, to the last
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = [reference.generate(p, **kwargs).tolist() for p in prompts]
    before = scrape(url)
    config = client_config(swarm, request_timeout_s=2.0 * BATCH_WAIT_S)
    with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=config) as ours:
        with ThreadPoolExecutor(SESSIONS) as pool:
            together = list(pool.map(lambda prompt: ours.generate(prompt, **kwargs).tolist(), prompts))
    after = scrape(url)
    assert together == expected
    passes = value(after, "bloompeer_server_batch_size_count") - value(before, "bloompeer_server_batch_size_count")
    requests = value(after, "bloompeer_server_batch_size_sum") - value(before, "bloompeer_server_batch_size_sum")
    assert passes >= NEW_TOKENS and requests == SESSIONS * passes, (
        f"{requests:.0f} requests in {passes:.0f} passes: not every pass held a step of each of the {SESSIONS} "
        f"sessions")
