"""The sequence classifier of every family (DistributedBloomForSequenceClassification,
DistributedLlamaForSequenceClassification): a trainable head on the swarm's model.

As transformers' sequence classifiers: a linear `score` head (no bias) on the hidden state of each
sequence's last real token, found from the attention mask (left or right padding). The head (and
prompts, with tuning_mode) train; the blocks stay frozen on the servers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from .base import DistributedModelMixin

__all__ = ["DistributedSequenceClassificationMixin"]


class DistributedSequenceClassificationMixin(DistributedModelMixin):
    """A family's classifier is this mixin and its family's PreTrainedModel (peer/client/families.py makes
    it): the remote base model and `score`, nn.Linear(hidden, num_labels, bias=False)."""

    def __init__(self, config, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config, tuning_mode, pre_seq_len)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def trainable_modules(self) -> list[nn.Module]:
        return [*super().trainable_modules(), self.score]

    @property
    def trained_locally(self) -> tuple[str, ...]:
        return (*super().trained_locally, "score.")

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                **kwargs) -> SequenceClassifierOutputWithPast:
        hidden = self.remote(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        logits = self.score(hidden.last_hidden_state)  # [batch, length, num_labels]
        batch = logits.shape[0]
        if attention_mask is not None:  # the last real token of each row, with left or right padding
            positions = torch.arange(attention_mask.shape[1], device=logits.device)
            last = (positions * attention_mask.to(logits.device, torch.long)).argmax(-1)
        else:
            last = torch.full((batch,), logits.shape[1] - 1, device=logits.device)
        pooled = logits[torch.arange(batch, device=logits.device), last]
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(pooled, labels) if self.config.num_labels > 1 else \
                nn.functional.mse_loss(pooled.squeeze(-1), labels.float())
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled)
