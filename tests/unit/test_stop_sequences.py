"""The API's stop-sequence criterion decodes only the end of the text each step: it must stop at the
same step as decoding the whole generated text would, wherever the stop falls, across token and
UTF-8 character boundaries, and never for a stop that starts in the prompt."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from bloompeer.peer.api.generation import _StopSequences
from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR

TEXT = ("It is a truth universally acknowledged — café, naïve, 東京 — that a single man in possession of a "
        "good fortune, must be in want of a wife. ") * 6 + "Mr. Darcy’s 北京 garçon: THE END"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def _first_stop(criterion, token_ids: list[int], prompt_length: int) -> int | None:
    """The number of tokens at the first step the criterion says stop (one new token a step)."""
    for length in range(prompt_length + 1, len(token_ids) + 1):
        if bool(criterion(torch.tensor([token_ids[:length]]), None)[0]):
            return length
    return None


def _first_stop_of_whole_text(tokenizer, token_ids: list[int], prompt_length: int, stops) -> int | None:
    for length in range(prompt_length + 1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[prompt_length:length], skip_special_tokens=True)
        if any(stop in text for stop in stops):
            return length
    return None


@pytest.mark.parametrize("stops", [
    ("wife. It",), ("é",), ("東京 —",), ("acknowledged", "fortune"), (" a ",),  # soon after the prompt
    ("y’s 北",), ("北京",), ("garçon: THE",), ("END", "absent"),  # long after: the window moved on
    ("absent from the text",),
])
def test_stops_at_the_step_decoding_everything_would(tokenizer, stops):
    token_ids = tokenizer(TEXT)["input_ids"]
    prompt_length = 40  # inside the second sentence: the first stops also occur in the prompt
    expected = _first_stop_of_whole_text(tokenizer, token_ids, prompt_length, stops)
    assert _first_stop(_StopSequences(tokenizer, prompt_length, stops), token_ids, prompt_length) == expected


def test_a_stop_that_starts_in_the_prompt_does_not_count(tokenizer):
    token_ids = tokenizer("It is a truth universally acknowledged")["input_ids"]
    prompt_length = len(tokenizer("It is a truth universally")["input_ids"])
    assert _first_stop(_StopSequences(tokenizer, prompt_length, ("universally acknowledged",)), token_ids,
                       prompt_length) is None
