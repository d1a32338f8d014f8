"""What a model family is to the rest of bloompeer: the answers that differ between families.

Everything above `blocks/` (scheduler, sessions, cache budget, wire, records, routing, push,
rollback, replay, verification, training, limits, metrics, the API) is one code for every family;
it asks the family's span for its computation and cache layout, and this description for the rest:
which checkpoints it reads, where a block's tensors are in them, and which tensors the client keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ModelFamily"]


@dataclass(frozen=True)
class ModelFamily:
    name: str  # "bloom", "llama": announced in DHT records; the client picks its model class by it
    config_classes: Mapping[str, str]  # config.model_type -> the transformers config class that reads it
    span_class: type  # its BlockSpan subclass
    block_prefix_format: str  # block i's tensors: "h.{}." (BLOOM), "model.layers.{}." (Llama family)
    stored_prefix: str  # a prefix some checkpoints put before every name ("transformer." in BLOOM's), dropped on reading
    client_tensor_prefixes: tuple[str, ...]  # what a client loads: embeddings, norms, LM head

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.config_classes)

    def block_prefix(self, block_index: int) -> str:
        return self.block_prefix_format.format(block_index)

    def config_class(self, model_type: str) -> type:
        import transformers  # its config classes are light; the modeling ones are never imported here

        return getattr(transformers, self.config_classes[model_type])
