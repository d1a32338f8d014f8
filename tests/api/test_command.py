"""`bloompeer api` with no peers: it starts a local swarm of the model, answers, and at SIGTERM
stops everything it started."""

from __future__ import annotations

import json
import re
import uuid

import torch
from transformers import AutoTokenizer

from tests.swarm.conftest import MARKER_ENV, processes_with_env

from .conftest import start_api


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
        exit_code = api.stop()
    assert exit_code == 0
    assert processes_with_env(MARKER_ENV, marker) == []
