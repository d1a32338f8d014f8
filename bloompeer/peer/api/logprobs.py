"""Token log-probabilities as the API returns them: each token's text, its logprob and the best
alternatives, in the completions shape (tokens, token_logprobs, top_logprobs, text_offset) or the
chat shape (content: [{token, logprob, bytes, top_logprobs}]).

A logprob is the log-softmax of the model's logits at that position, before temperature, top_p,
penalties or logit_bias change them: the model's own distribution, which is what a harness scores.

A token's text is the text it adds in its context (decoded with the tokens before it, as the
response's text is), so the tokens of a choice add up to its text and `text_offset` indexes it.
A byte-level token that is half a character adds nothing (""); the token that completes the
character carries it. Alternatives are named the same way; two that read alike keep the better
logprob, so the best alternative is always listed (lm-eval's greedy check relies on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .decoding import CONTEXT_TOKENS, INCOMPLETE_CHARACTER

__all__ = ["TokenLogprob", "TokenTexts", "chat_logprobs", "completion_logprobs", "top_alternatives"]


@dataclass(frozen=True)
class TokenLogprob:
    token: str  # the text this token adds (a special token: its name, adding nothing to the text)
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[str, float], ...] = ()  # the best alternatives, best first
    offset: int = 0  # where this token's text starts in the choice's text
    text_length: int = 0  # how many characters of the choice's text it adds

    def shifted(self, by: int) -> TokenLogprob:
        return replace(self, offset=self.offset + by)


def top_alternatives(logprobs: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k most likely token ids of one position's logprobs [vocab], best first, and their logprobs."""
    if k <= 0:
        return [], []
    values, ids = torch.topk(logprobs, k)
    return ids.tolist(), values.tolist()


class TokenTexts:
    """The texts of one sequence's tokens, one token at a time (see the module docstring)."""

    def __init__(self, tokenizer, start_offset: int = 0):
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.token_ids: list[int] = []
        self.done = 0  # tokens whose text is settled (the rest are pieces of an unfinished character)
        self.offset = start_offset  # where the next settled text starts

    def add(self, token_id: int, logprob: float | None, top_ids: Sequence[int] = (),
            top_logprobs: Sequence[float] = ()) -> TokenLogprob:
        context_start = max(0, self.done - CONTEXT_TOKENS)
        context = self.token_ids[context_start:]
        before = self._decode(context[:self.done - context_start])
        self.token_ids.append(token_id)
        if token_id in self.special_ids:
            text, name = "", self.tokenizer.convert_ids_to_tokens(token_id)
        else:
            text = self._decode(context + [token_id])[len(before):]
            if text.endswith(INCOMPLETE_CHARACTER):
                text = ""  # half a character: the token that completes it carries it
            name = text
        if text or token_id in self.special_ids:
            self.done = len(self.token_ids)
        top = self._name_alternatives(context, before, top_ids, top_logprobs)
        entry = TokenLogprob(name, logprob, top, self.offset, len(text))
        self.offset += len(text)
        return entry

    def _name_alternatives(self, context: list[int], before: str, ids: Sequence[int],
                           logprobs: Sequence[float]) -> tuple[tuple[str, float], ...]:
        named: dict[str, float] = {}
        for token_id, logprob in zip(ids, logprobs):  # best first: a name seen already keeps its better logprob
            if token_id in self.special_ids:
                name = self.tokenizer.convert_ids_to_tokens(token_id)
            else:
                name = self._decode(context + [token_id])[len(before):]
            named.setdefault(name, logprob)
        return tuple(named.items())

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""


def completion_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    """OpenAI's completions shape; a position with no alternatives asked for has an empty dict."""
    return {"tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [None if entry.logprob is None else dict(entry.top) for entry in entries],
            "text_offset": [entry.offset for entry in entries]}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    """OpenAI's chat shape."""
    def described(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**described(entry.token, entry.logprob),
                         "top_logprobs": [described(token, logprob) for token, logprob in entry.top]}
                        for entry in entries],
            "refusal": None}
