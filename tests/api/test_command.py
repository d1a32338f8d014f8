"""`bloompeer api` with no peers: it starts a local swarm of the model, answers, and at SIGTERM
stops everything it started; and at SIGTERM with requests in flight it still exits, promptly."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
import uuid

import torch
from transformers import AutoTokenizer

from tests.swarm.conftest import MARKER_ENV, processes_with_env

from .conftest import gauge, start_api, start_waiting_api

MAX_CONCURRENT = 4


def test_api_without_peers_runs_a_local_swarm_and_leaves_nothing(tiny_checkpoint, reference_model, tmp_path):
    marker = uuid.uuid4().hex
    api = start_api(tiny_checkpoint, tmp_path, env={"BLOOMPEER_INITIAL_PEERS": "", "BLOOMPEER_CACHE": str(tmp_path),
                                                     MARKER_ENV: marker})
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", api.url)
        status, _, body = api.post_json("/v1/completions", {"model": tiny_checkpoint.name, "prompt": "Local",
                                                            "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
        ids = tokenizer("Local", return_tensors="pt").input_ids
        with torch.inference_mode():
            expected = reference_model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert json.loads(body)["choices"][0]["text"] == tokenizer.decode(expected[0, ids.shape[1]:],
                                                                         skip_special_tokens=True)
        assert "starting a local swarm" in api.process.log_path.read_text()
    finally:
        exit_code = api.stop(timeout_s=90.0)  # it stops its local swarm too; SIGKILL (-9) only past this guard
    assert exit_code == 0
    assert processes_with_env(MARKER_ENV, marker) == []


def test_sigterm_with_requests_in_flight_exits_and_leaves_nothing(swarm, tiny_checkpoint, tmp_path):
    """Requests wait for blocks (MAX_CONCURRENT on the API's threads, the rest queued for one) when the
    API is told to stop: uvicorn gives up on them after its grace period, and the client's shutdown
    then ends the work still in flight. Before, a generation thread ending could ask the stopping
    client to close its session and wait forever on a loop that no longer ran, and the process with it."""
    marker = uuid.uuid4().hex
    api = start_waiting_api(swarm, tiny_checkpoint, tmp_path, "--max-concurrent", str(MAX_CONCURRENT),
                            env={MARKER_ENV: marker})
    body = json.dumps({"model": tiny_checkpoint.name, "prompt": "Wait", "max_tokens": 4}).encode()
    requests = MAX_CONCURRENT * 3
    for _ in range(requests):
        threading.Thread(target=_post_ignoring_failure, args=(api.url + "/completions", body), daemon=True).start()
    deadline = time.monotonic() + 60
    while gauge(api, "bloompeer_api_generations_in_progress") < requests:
        assert time.monotonic() < deadline, "the requests never all arrived"
        time.sleep(0.25)

    exit_code = api.stop(timeout_s=90.0)  # SIGTERM; SIGKILL (exit code -9) if still running then
    assert exit_code == 0, api.process.log_tail(60)
    assert processes_with_env(MARKER_ENV, marker) == []


def _post_ignoring_failure(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()
    except OSError:
        pass  # the API stopped under it: what the test is about
