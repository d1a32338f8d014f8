"""The Llama family's client classes (Llama, Mistral, Qwen2, Qwen3): what a client holds of such a
model (token embeddings, the final RMSNorm, the LM head, tied to the embeddings or not as
`tie_word_embeddings` says) under transformers' names."""

from __future__ import annotations

import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

from ...blocks.llama import RMSNorm
from .base import RemoteBlocksModel
from .classification import DistributedSequenceClassificationMixin
from .model import DistributedCausalLMMixin

__all__ = ["DistributedLlamaForCausalLM", "DistributedLlamaForSequenceClassification", "DistributedLlamaModel"]


class DistributedLlamaModel(RemoteBlocksModel, LlamaPreTrainedModel):
    """LlamaModel (or Mistral's, Qwen2's, Qwen3's) with remote blocks: embed_tokens -> swarm -> norm."""

    def __init__(self, config, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._init_remote(config, tuning_mode, pre_seq_len)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.embed_tokens = new_embeddings

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def to_swarm(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return inputs_embeds

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class DistributedLlamaForCausalLM(DistributedCausalLMMixin, LlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        self.model = DistributedLlamaModel(config, tuning_mode, pre_seq_len)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_to_embeddings()


class DistributedLlamaForSequenceClassification(DistributedSequenceClassificationMixin, LlamaPreTrainedModel):
    def __init__(self, config, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        self.model = DistributedLlamaModel(config, tuning_mode, pre_seq_len)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()
