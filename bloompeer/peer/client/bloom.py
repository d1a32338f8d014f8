"""The BLOOM family's client classes: what a client holds of a BLOOM model (word embeddings, their
layernorm, the final layernorm; the LM head is tied to the embeddings) under transformers' names."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BloomConfig
from transformers.generation import GenerationMixin
from transformers.models.bloom.modeling_bloom import BloomPreTrainedModel

from .base import RemoteBlocksModel
from .classification import DistributedSequenceClassificationMixin
from .model import DistributedCausalLMMixin

__all__ = ["DistributedBloomForCausalLM", "DistributedBloomForSequenceClassification", "DistributedBloomModel"]


class DistributedBloomModel(RemoteBlocksModel, BloomPreTrainedModel):
    """BloomModel with remote blocks: embeddings -> their layernorm -> swarm -> ln_f."""

    def __init__(self, config: BloomConfig, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self._init_remote(config, tuning_mode, pre_seq_len)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embeddings

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.word_embeddings = new_embeddings

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)

    def to_swarm(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings_layernorm(inputs_embeds)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden)


class DistributedBloomForCausalLM(DistributedCausalLMMixin, BloomPreTrainedModel, GenerationMixin):
    def __init__(self, config: BloomConfig, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        self.transformer = DistributedBloomModel(config, tuning_mode, pre_seq_len)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_to_embeddings()


class DistributedBloomForSequenceClassification(DistributedSequenceClassificationMixin, BloomPreTrainedModel):
    def __init__(self, config: BloomConfig, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        self.transformer = DistributedBloomModel(config, tuning_mode, pre_seq_len)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()
