"""Stream pieces (no processes): half characters and possible starts of stop sequences wait; the
pieces always add up to the text decoded at once, cut before the first stop sequence."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from bloompeer.peer.api.decoding import CONTEXT_TOKENS, IncrementalText
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


def _long_token_ids(tokenizer, count: int) -> list[int]:
    """Text in three scripts (characters of one to four UTF-8 bytes, split over byte tokens), with
    special tokens sprinkled in, cut to `count` tokens (so it may end inside a character)."""
    text = "Emma Woodhouse, née Ⅰ — 東京の春 🌸 est arrivée.\n" * (count // 20 + 1)
    ids = tokenizer(text).input_ids
    for index in range(7, len(ids), 97):
        ids.insert(index, tokenizer.all_special_ids[0])
    return ids[:count]


@pytest.mark.parametrize("stops", [[], ["arrivée.\nEmma W"], ["🌸 est", "京の"]], ids=["none", "late", "early"])
def test_a_long_stream_adds_up_to_the_whole_text_decoded_at_once(tokenizer, stops):
    ids = _long_token_ids(tokenizer, 2000)
    decoder = IncrementalText(tokenizer, stops)
    chunks, index = [], 0
    while index < len(ids):  # one, two or three tokens at a time, as a speculative step adds them
        chunks.append(ids[index:index + 1 + len(chunks) % 3])
        index += len(chunks[-1])
    pieces = [decoder.add(chunk) for chunk in chunks]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [whole.find(stop) for stop in stops if stop in whole]
    assert "".join(pieces) + decoder.finish() == (whole[:min(cuts)] if cuts else whole)


def test_each_step_decodes_only_the_new_tokens_and_a_few_before_them(tokenizer):
    """Decoding the whole text again at every token made a long stream quadratic."""
    class Counting:
        def __init__(self):
            self.decoded = 0

        def decode(self, ids, **kwargs):
            self.decoded += len(ids)
            return tokenizer.decode(ids, **kwargs)

    counting, ids = Counting(), _long_token_ids(tokenizer, 2000)
    decoder = IncrementalText(counting, ["never appears"])
    for token in ids:
        decoder.add([token])
    assert counting.decoded <= 2 * (CONTEXT_TOKENS + 4) * len(ids)
