"""Prompt scoring: the logprob of every prompt token, from one full forward through the swarm per
batch of prompts (no inference session, nothing generated, nothing kept on the servers).

This is what an evaluation harness asks for most (`echo` with `logprobs` and max_tokens 0 or 1):
the prompts of a request are padded on the right into one batch and run as one
`model(input_ids, attention_mask=...)`; right padding leaves every real token's logits as they
are alone (attention is causal, and pads come after). A batch is cut where its logits
(rows x padded length x vocabulary, float32) would pass MAX_BATCH_LOGITS; prompts are sorted by
length first, so that little is padding. The last position's logits also give the token that a
choice with max_tokens 1 picks, so such a choice needs no session either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["MAX_BATCH_LOGITS", "PromptScores", "score_prompts"]

MAX_BATCH_LOGITS = 2 ** 27  # float32 logits of one batch: 512 MiB (a single longer prompt still runs alone)


@dataclass
class PromptScores:
    """One prompt's scores. Position i of token_logprobs/top is the prompt's token i + 1."""

    token_logprobs: list[float]  # [length - 1]
    top: list[tuple[list[int], list[float]]]  # [length - 1] (ids, logprobs) of the best alternatives, best first
    next_logits: torch.Tensor  # [vocab] raw logits after the whole prompt (for a token picked right after it)

    def next_logprobs(self) -> torch.Tensor:
        return torch.log_softmax(self.next_logits.float(), dim=-1)


def score_prompts(model, prompts: Sequence[Sequence[int]], num_top: int, pad_token_id: int,
                  with_tokens: bool = True, on_pass: Callable[[], None] = lambda: None) -> list[PromptScores]:
    """Scores of each prompt, in order. num_top: alternatives per position (0 for none);
    with_tokens=False computes only next_logits (no prompt logprobs were asked for).
    on_pass() is called for each forward pass through the swarm."""
    scores: list[PromptScores | None] = [None] * len(prompts)
    for batch in _batches(prompts, model.config.vocab_size):
        on_pass()
        for index, row in zip(batch, _forward(model, [prompts[i] for i in batch], pad_token_id, num_top,
                                              with_tokens)):
            scores[index] = row
    return scores


def _batches(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Indices of the prompts, by length, cut into batches within MAX_BATCH_LOGITS."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches: list[list[int]] = []
    for index in order:  # lengths only grow, so this prompt's length is the batch's padded length
        if batches and (len(batches[-1]) + 1) * len(prompts[index]) * vocab_size <= MAX_BATCH_LOGITS:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


@torch.inference_mode()
def _forward(model, prompts: list[Sequence[int]], pad_token_id: int, num_top: int,
             with_tokens: bool) -> list[PromptScores]:
    lengths = [len(prompt) for prompt in prompts]
    input_ids = torch.full((len(prompts), max(lengths)), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, :len(prompt)] = 1
    logits = model(input_ids, attention_mask=attention_mask).logits  # [batch, length, vocab]
    rows = []
    for row, length in enumerate(lengths):
        next_logits = logits[row, length - 1].float().clone()
        if not with_tokens:
            rows.append(PromptScores([], [], next_logits))
            continue
        logprobs = torch.log_softmax(logits[row, :length - 1].float(), dim=-1)  # [length - 1, vocab]
        targets = input_ids[row, 1:length]
        token_logprobs = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top = _top_alternatives(logprobs, num_top)
        rows.append(PromptScores(token_logprobs, top, next_logits))
    return rows


def _top_alternatives(logprobs: torch.Tensor, k: int) -> list[tuple[list[int], list[float]]]:
    """(ids, logprobs) of the k best tokens at each position of logprobs [positions, vocab]."""
    if k <= 0:
        return [([], [])] * logprobs.shape[0]
    values, ids = torch.topk(logprobs, k, dim=-1)
    return list(zip(ids.tolist(), values.tolist()))
