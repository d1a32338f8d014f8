"""A choice's tokens as the pieces a response is built from: text that can no longer change (see
decoding.py), with the logprobs of the tokens that text holds, and at the end why it ended.

Both ways a choice gets tokens (generate() through a session, or a scoring pass's one token) go
through PieceMaker, so a streamed choice adds up to the same text and logprobs as a plain one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .decoding import IncrementalText
from .logprobs import TokenLogprob, TokenTexts

__all__ = ["PieceMaker", "TextPiece", "TokenScore", "echo_piece"]

TokenScore = tuple[float, list[int], list[float]]  # a token's logprob; its best alternatives' ids and logprobs


@dataclass(frozen=True)
class TextPiece:
    """What a stream sends next: new text, and on the last piece why the choice ended."""

    text: str
    finish_reason: str | None = None  # "stop" (end of text or a stop sequence) | "length" | None: not the last
    completion_tokens: int = 0  # tokens generated so far
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens whose text this piece holds (or the end of it)

    def shifted(self, by: int) -> TextPiece:
        """The same piece in a text that starts `by` characters earlier (after the echoed prompt)."""
        if not by or not self.logprobs:
            return self
        return TextPiece(self.text, self.finish_reason, self.completion_tokens,
                         tuple(entry.shifted(by) for entry in self.logprobs))


class PieceMaker:
    """Tokens in as they come, TextPieces out. A token's logprobs are released with its text: a
    token whose text is held back (half a character, a possible start of a stop sequence) waits,
    and one after a stop sequence is never released."""

    def __init__(self, tokenizer, stops: Sequence[str], max_new_tokens: int, eos_ids: set[int],
                 with_logprobs: bool, special_tokens: bool = False):
        self.text = IncrementalText(tokenizer, stops, special_tokens)
        self.token_texts = TokenTexts(tokenizer) if with_logprobs else None
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.held: list[TokenLogprob] = []
        self.num_tokens, self.last_token = 0, None

    def add(self, token_ids: Sequence[int], scores: Sequence[TokenScore] | None = None) -> TextPiece | None:
        """The piece these tokens make final, or None if nothing is."""
        self.num_tokens += len(token_ids)
        self.last_token = token_ids[-1]
        if self.token_texts is not None:
            self.held.extend(self.token_texts.add(token_id, *score) for token_id, score in zip(token_ids, scores))
        text = self.text.add(token_ids)
        released = self._release(len(self.text.sent))
        return TextPiece(text, None, self.num_tokens, released) if text or released else None

    def finish(self) -> TextPiece:
        """The last piece, once no more tokens come."""
        text = self.text.finish()
        released = self._release(len(self.text.sent) if self.text.stopped else None)
        stopped = self.text.stopped or self.last_token in self.eos_ids or self.num_tokens < self.max_new_tokens
        return TextPiece(text, "stop" if stopped else "length", self.num_tokens, released)

    def _release(self, text_length: int | None) -> tuple[TokenLogprob, ...]:
        """Held entries that start before text_length (all of them if None), in order."""
        count = 0
        while count < len(self.held) and (text_length is None or self.held[count].offset < text_length):
            count += 1
        released, self.held = tuple(self.held[:count]), self.held[count:]
        return released


def echo_piece(tokenizer, prompt_ids: Sequence[int], token_logprobs: Sequence[float] | None = None,
               top: Sequence[tuple[list[int], list[float]]] = ()) -> TextPiece:
    """The prompt as the start of a choice's text; with its tokens' logprobs (the first has none) if given."""
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
    if token_logprobs is None:
        return TextPiece(text)
    texts = TokenTexts(tokenizer)
    entries = [texts.add(prompt_ids[0], None)]
    entries += [texts.add(token_id, logprob, ids, logprobs)
                for token_id, logprob, (ids, logprobs) in zip(prompt_ids[1:], token_logprobs, top)]
    return TextPiece(text, logprobs=tuple(entries))
