"""Token ids to text as they arrive: the pieces a stream sends, stop sequences cut off.

A token is not always whole text: a byte-level token can be half of a UTF-8 character, and the
text so far can end with the start of a stop sequence. So each piece is the part of the text
that can no longer change; the rest is held back until more tokens (or the end) decide it. The
pieces of a stream concatenate to exactly the text of the same tokens decoded at once, which is
what a non-streamed response returns.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["IncrementalText"]

INCOMPLETE_CHARACTER = "\ufffd"  # what decoding makes of an unfinished UTF-8 sequence


class IncrementalText:
    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.token_ids: list[int] = []
        self.sent = ""  # the text handed out so far
        self.stopped = False  # a stop sequence appeared; the text ends before it

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new tokens; returns the text that is now final (maybe ""). Nothing after a stop."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self._text_before_stop()
        if not self.stopped:
            text = text.rstrip(INCOMPLETE_CHARACTER)
            text = text[:len(text) - self._held_for_stop(text)]
        return self._send(text)

    def finish(self) -> str:
        """The rest of the text, once no more tokens come."""
        return self._send(self._text_before_stop())

    @property
    def text(self) -> str:
        return self.sent

    def _text_before_stop(self) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in self.stops if stop in text]
        if cuts:
            self.stopped = True
            return text[:min(cuts)]
        return text

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest end of `text` that could be the start of a stop sequence."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _send(self, text: str) -> str:
        # decoding more tokens only appends to byte-level text; if a tokenizer ever rewrote the
        # text already sent, wait for it to settle rather than send text that contradicts it
        if not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece
