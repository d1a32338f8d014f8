"""How one choice picks its tokens: OpenAI's penalties and logit_bias, temperature, top_p and a
draw from the choice's own generator, as transformers logits processors.

The same list serves generate() (every step of a choice) and a prompt's scoring pass (the one
token of a choice with max_tokens 1, picked from that pass's last logits), so both pick alike.
Order, as OpenAI describes it: penalties and bias change the logits, then temperature and top_p
shape the distribution the token is drawn from. A grammar (constrained.py) masks what it forbids
between the two, so that temperature and top_p share the probability out among allowed tokens
only. Temperature 0 is greedy: no draw, generate's argmax (or scoring's) takes the best allowed
token after penalties and bias.

Sampling draws from a torch.Generator of the choice's own (seeded by `seed`), so a seeded choice
gives the same text however many others run at the same time: the last processor draws the
token and leaves only it possible, so the greedy pick takes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import (
    LogitsProcessor, LogitsProcessorList, SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper,
)

from .constrained import Grammar

__all__ = ["OpenAIPenalties", "Sampling", "pick_token"]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    grammar: Grammar | None = None  # the reply must follow it (response_format, tools); None: free text

    def processors(self, prompt_length: int) -> LogitsProcessorList:
        """The processors of one choice whose prompt is `prompt_length` tokens (penalties count only
        the tokens generated after it)."""
        processors = LogitsProcessorList()
        if self.presence_penalty or self.frequency_penalty:
            processors.append(OpenAIPenalties(prompt_length, self.presence_penalty, self.frequency_penalty))
        if self.logit_bias:
            processors.append(SequenceBiasLogitsProcessor({(token,): bias for token, bias in self.logit_bias.items()}))
        if self.grammar is not None:
            processors.append(self.grammar.processor(prompt_length))
        if self.temperature == 0:
            return processors
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        if self.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(self.temperature))
        if self.top_p < 1.0:
            processors.append(TopPLogitsWarper(self.top_p))
        processors.append(_SampleWithGenerator(generator))
        return processors


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties: a token's logit goes down by frequency_penalty
    for each time it was generated so far, and by presence_penalty once if it was generated at all.
    Only generated tokens count, not the prompt's. (transformers' RepetitionPenaltyLogitsProcessor
    is another rule: it scales logits, and counts the prompt.)"""

    def __init__(self, prompt_length: int, presence_penalty: float, frequency_penalty: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence_penalty, frequency_penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length:]  # [batch, generated so far]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


class _SampleWithGenerator(LogitsProcessor):
    """Draws the next token from softmax(scores) with the choice's generator; only it stays possible."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)  # [batch, 1]
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


def pick_token(processors: LogitsProcessorList, prompt_ids: list[int], logits: torch.Tensor) -> int:
    """The token generate() would pick after `prompt_ids` from these next-token logits [vocab]."""
    scores = processors(torch.tensor([prompt_ids]), logits.float()[None].clone())
    return int(scores[0].argmax())
