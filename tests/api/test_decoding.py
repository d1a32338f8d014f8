"""Stream pieces (no processes): half characters and possible starts of stop sequences wait; the
pieces always add up to the text decoded at once, cut before the first stop sequence."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from bloompeer.peer.api.decoding import IncrementalText
from bloompeer.peer.cli.default_model import write_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(directory)
    return AutoTokenizer.from_pretrained(directory)


def _pieces(tokenizer, text, stops=()):
    decoder = IncrementalText(tokenizer, stops)
    pieces = [decoder.add([token]) for token in tokenizer(text).input_ids]
    return pieces, decoder.finish(), decoder


def test_a_half_character_waits_for_its_other_bytes(tokenizer):
    pieces, rest, _ = _pieces(tokenizer, "né")  # "é" is two byte tokens
    assert pieces == ["n", "", "é"] and rest == ""


@pytest.mark.parametrize("text, stops, expected", [
    ("Hello User: there", ["User:"], "Hello "),
    ("Hello Us", ["User:"], "Hello Us"),  # a stop sequence begun but never finished is text after all
    ("abcabd", ["abd", "cab"], "ab"),  # the earliest stop sequence wins
    ("plain text", [], "plain text"),
])
def test_pieces_add_up_to_the_text_cut_before_the_stop(tokenizer, text, stops, expected):
    pieces, rest, decoder = _pieces(tokenizer, text, stops)
    assert "".join(pieces) + rest == expected
    assert decoder.stopped == (expected != text)


def test_text_that_may_start_a_stop_sequence_is_held_back(tokenizer):
    decoder = IncrementalText(tokenizer, ["\nUser:"])
    assert decoder.add(tokenizer("Hi").input_ids) == "Hi"
    assert decoder.add(tokenizer("\nUs").input_ids) == ""  # could be the stop sequence: held
    assert decoder.add(tokenizer("ually").input_ids) == "\nUsually"  # it was not
    assert decoder.add(tokenizer("\nUser: more").input_ids) == ""
    assert decoder.stopped and decoder.finish() == "" and decoder.text == "Hi\nUsually"
