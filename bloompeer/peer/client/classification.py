"""DistributedBloomForSequenceClassification: a trainable head on the swarm's BLOOM.

As transformers' BloomForSequenceClassification: a linear `score` head on the hidden state of
each sequence's last non-padding token. The head (and prompts, with tuning_mode) train; the blocks
stay frozen on the servers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BloomConfig
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.models.bloom.modeling_bloom import BloomPreTrainedModel

from .base import DistributedBloomModel, DistributedModelMixin

__all__ = ["DistributedBloomForSequenceClassification"]


class DistributedBloomForSequenceClassification(DistributedModelMixin, BloomPreTrainedModel):
    def __init__(self, config: BloomConfig, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = DistributedBloomModel(config, tuning_mode, pre_seq_len)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def trainable_modules(self) -> list[nn.Module]:
        return [*super().trainable_modules(), self.score]

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                **kwargs) -> SequenceClassifierOutputWithPast:
        hidden = self.transformer(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
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
            loss = nn.functional.cross_entropy(pooled, labels) if self.num_labels > 1 else \
                nn.functional.mse_loss(pooled.squeeze(-1), labels.float())
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled)
