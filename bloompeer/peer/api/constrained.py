"""Constrained decoding: a choice whose reply must follow a grammar (a JSON schema, any JSON object,
a tool call) may only pick tokens that keep it in the grammar.

The grammar acts on the logits this client computes (its LM head), so the guarantee holds over any
swarm, whatever servers computed the hidden states: at each step the matcher computes which tokens
the grammar allows after the tokens so far, and every other logit becomes -inf before the choice's
sampling draws (sampling.py places it after penalties and bias, before temperature and top_p).
Once the grammar is complete only the end-of-text tokens stay possible, so the choice ends there.

The library is llguidance (guidance-ai), chosen by benchmarks/constrained_decoding.py on our
tokenizers against xgrammar (docs/performance.md#constrained-decoding-benchmarksconstrained_decodingpy):
both cost tens of microseconds a token (llguidance's p90 1 ms with 76k tokens), under 1% of a real
model's decode step (2% of the tiny demo model's), but llguidance compiles a schema in
under 1 ms with any vocabulary (xgrammar precomputes masks: 80-90 ms a schema with 76k tokens), and
is a 7.6 MB wheel with no dependencies (xgrammar requires triton on Linux x86_64: 1 GB more for a
CPU install, whose whole image is 1.6 GB).

The matcher follows the sequence it is given rather than counting calls: it rolls back to the
longest prefix it shares with the tokens generated so far and consumes the rest. So the same
processor serves plain decoding, a scoring pass's one token, and transformers' speculative decoding
(assistant_model: the API has no draft model yet), whose verify pass asks for the logits after each
candidate prefix in turn and then drops the rejected tail (tests/unit/test_constrained.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import LogitsProcessor

__all__ = ["ConstrainedLogits", "Grammar", "GrammarCompiler", "UnsupportedGrammar"]

logger = logging.getLogger(__name__)

# JSON as a reply is written: no whitespace ("," and ":" bare, llguidance's defaults), since a model
# free to add whitespace may add it forever (a small model's run of newlines never closes the object)
_JSON_FORMAT = {"whitespace_flexible": False}


class UnsupportedGrammar(ValueError):
    """The library cannot compile this grammar; the message says what it refused."""


@dataclass(frozen=True)
class Grammar:
    """A grammar checked against the tokenizer, ready to constrain any number of choices."""

    text: str  # llguidance's grammar (from a JSON schema or Lark)
    tokenizer: llguidance.LLTokenizer = field(compare=False, repr=False)

    def processor(self, prompt_length: int) -> ConstrainedLogits:
        """A processor for one choice whose prompt is `prompt_length` tokens (those are never constrained)."""
        return ConstrainedLogits(llguidance.LLMatcher(self.tokenizer, self.text, log_level=0), self.tokenizer,
                                 prompt_length)


class GrammarCompiler:
    """The tokenizer as llguidance reads it (once per API: 0.01 s for the demo model's 4096 tokens,
    0.6 s for 76k), and grammars compiled against it."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_ids) or None)

    def json_schema(self, schema: dict[str, Any], strict: bool = True) -> Grammar:
        """Replies that are JSON valid against `schema`. strict: a keyword the library does not
        implement is refused (else ignored, which may let through replies the schema forbids)."""
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                 defaults={**_JSON_FORMAT, "lenient": not strict})
        except ValueError as exc:
            raise UnsupportedGrammar(f"not a JSON schema: {exc}") from None
        return self._checked(text)

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's json_object)."""
        return self.json_schema({"type": "object"})

    def lark(self, lark: str) -> Grammar:
        """Replies of a Lark grammar (llguidance's syntax: `%json {schema}` embeds a JSON schema)."""
        return self._checked(llguidance.LLMatcher.grammar_from_lark(lark))

    def _checked(self, text: str) -> Grammar:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if is_error:
            raise UnsupportedGrammar("; ".join(messages))
        return Grammar(text, self.tokenizer)


class ConstrainedLogits(LogitsProcessor):
    """Masks every token the grammar does not allow after the generated tokens (one sequence)."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, prompt_length: int):
        self.matcher, self.prompt_length, self.eos_ids = matcher, prompt_length, tokenizer.eos_tokens
        self.consumed: list[int] = []  # generated tokens the matcher has taken, in order

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != 1:
            raise ValueError(f"a constrained choice decodes one sequence, not {input_ids.shape[0]}")
        self._follow(input_ids[0, self.prompt_length:].tolist())
        allowed = self._allowed(scores.shape[-1])  # [vocab]
        return torch.where(allowed, scores, float("-inf"))

    def _follow(self, generated: list[int]) -> None:
        """Bring the matcher to the longest prefix of `generated` the grammar accepts."""
        shared = 0
        for ours, theirs in zip(self.consumed, generated):
            if ours != theirs:
                break
            shared += 1
        if shared < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - shared)
            del self.consumed[shared:]
        rest = generated[shared:]
        if rest:
            taken = self.matcher.try_consume_tokens(rest)  # fewer: a speculative candidate the grammar refuses,
            self.consumed.extend(rest[:taken])  # whose tail the verify pass will drop

    def _allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab] True where the grammar allows the token. A byte a token (llguidance's "logit bias"):
        6 us for 4096 tokens, where unpacking its 1-bit mask with torch ops took 30."""
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = allowed[:vocab_size].bool()
        if not allowed.any():  # the matcher failed (a bug): end the choice rather than pick a refused token
            logger.warning("Constrained decoding found no allowed token: %s", self.matcher.get_error())
            allowed[self.eos_ids] = True
        return allowed
