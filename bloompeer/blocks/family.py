"""What a model family is to the rest of bloompeer: the answers that differ between families.

Everything above `blocks/` (scheduler, sessions, cache budget, wire, records, routing, push,
rollback, replay, verification, training, limits, metrics, the API) is one code for every family;
it asks the family's span for its computation and cache layout, and this description for the rest:
which checkpoints it reads, where a block's tensors are in them, and what the client holds. The
client's model classes are made from `client` (peer/client/families.py), so a family is declared
here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ClientParts", "ModelFamily"]


@dataclass(frozen=True)
class ClientParts:
    """What a client holds of a model of the family, under transformers' names: its base model's
    modules (the token embeddings, a norm before the first block if any, the final norm) and an LM
    head (tied to the embeddings or not, as the config says)."""

    class_name: str  # the client classes' stem: Distributed{class_name}Model, ...ForCausalLM, ...
    pretrained_model: str  # transformers' PreTrainedModel class of the family, which the client classes are too
    tensor_prefix: str  # before the base model's tensors in a checkpoint (after stored_prefix): "", "model."
    embeddings: str  # the base model's module that embeds tokens
    embedding_norm: str | None  # the one between the embeddings and the first block (BLOOM's), or None
    final_norm: str  # the one after the last block
    make_modules: Callable[[Any], dict[str, nn.Module]]  # config -> those modules, by the three names above

    @property
    def module_names(self) -> tuple[str, ...]:
        return tuple(name for name in (self.embeddings, self.embedding_norm, self.final_norm) if name is not None)


@dataclass(frozen=True)
class ModelFamily:
    name: str  # "bloom", "llama": announced in DHT records; the client picks its model class by it
    config_classes: Mapping[str, str]  # config.model_type -> the transformers config class that reads it
    span_class: type  # its BlockSpan subclass
    block_prefix_format: str  # block i's tensors: "h.{}." (BLOOM), "model.layers.{}." (Llama family)
    stored_prefix: str  # a prefix some checkpoints put before every name ("transformer." in BLOOM's), dropped on reading
    client: ClientParts

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.config_classes)

    @property
    def client_tensor_prefixes(self) -> tuple[str, ...]:
        """What a client loads of a checkpoint: its modules' tensors and the LM head."""
        return (*(f"{self.client.tensor_prefix}{name}." for name in self.client.module_names), "lm_head.")

    def block_prefix(self, block_index: int) -> str:
        return self.block_prefix_format.format(block_index)

    def config_class(self, model_type: str) -> type:
        import transformers  # its config classes are light; the modeling ones are never imported here

        return getattr(transformers, self.config_classes[model_type])
