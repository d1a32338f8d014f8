"""The client classes of every served family, made from the family's own description
(blocks/family.py, `ModelFamily.client`): nothing about a family is written twice.

Each family gets three classes, as transformers has them: the base model whose blocks run in the
swarm (Distributed{Name}Model), the causal LM (Distributed{Name}ForCausalLM) and the sequence
classifier (Distributed{Name}ForSequenceClassification). Each is also the family's transformers
PreTrainedModel, so that generate, the Trainer and PEFT-style tuning take it as one of theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from transformers.generation import GenerationMixin

from ...blocks import FAMILIES, ModelFamily
from .base import RemoteBlocksModel
from .classification import DistributedSequenceClassificationMixin
from .model import DistributedCausalLMMixin

__all__ = [
    "ClientClasses", "DistributedBloomForCausalLM", "DistributedBloomForSequenceClassification", "DistributedBloomModel",
    "DistributedLlamaForCausalLM", "DistributedLlamaForSequenceClassification", "DistributedLlamaModel",
    "DistributedQwen3NextForCausalLM", "DistributedQwen3NextForSequenceClassification", "DistributedQwen3NextModel",
    "client_classes",
]


@dataclass(frozen=True)
class ClientClasses:
    model: type
    causal_lm: type
    sequence_classification: type


def _make(name: str, bases: tuple[type, ...], **attributes) -> type:
    """A class of this module, as if written in it (its name resolves here: pickle, repr, docs)."""
    return type(name, bases, {"__module__": __name__, "__qualname__": name, **attributes})


def _classes_of(family: ModelFamily) -> ClientClasses:
    parts = family.client
    pretrained = getattr(transformers, parts.pretrained_model)
    stem = f"Distributed{parts.class_name}"
    model = _make(f"{stem}Model", (RemoteBlocksModel, pretrained), parts=parts,
                  __doc__=f"{parts.class_name}'s base model with its blocks in the swarm.")
    causal_lm = _make(f"{stem}ForCausalLM", (DistributedCausalLMMixin, pretrained, GenerationMixin),
                      base_model_class=model, __doc__=f"{parts.class_name}'s causal LM with its blocks in the swarm.")
    classifier = _make(f"{stem}ForSequenceClassification", (DistributedSequenceClassificationMixin, pretrained),
                       base_model_class=model,
                       __doc__=f"{parts.class_name}'s sequence classifier with its blocks in the swarm.")
    return ClientClasses(model, causal_lm, classifier)


_CLASSES = {family.name: _classes_of(family) for family in FAMILIES}


def client_classes(family_name: str) -> ClientClasses:
    """The classes of a family (ModelFamily.name), as servers announce it."""
    return _CLASSES[family_name]


# The public names (bloompeer/__init__.py exports them; tests/unit/test_exports.py checks that every
# family's are there)
DistributedBloomModel, DistributedBloomForCausalLM, DistributedBloomForSequenceClassification = (
    _CLASSES["bloom"].model, _CLASSES["bloom"].causal_lm, _CLASSES["bloom"].sequence_classification)
DistributedLlamaModel, DistributedLlamaForCausalLM, DistributedLlamaForSequenceClassification = (
    _CLASSES["llama"].model, _CLASSES["llama"].causal_lm, _CLASSES["llama"].sequence_classification)
DistributedQwen3NextModel, DistributedQwen3NextForCausalLM, DistributedQwen3NextForSequenceClassification = (
    _CLASSES["qwen3_next"].model, _CLASSES["qwen3_next"].causal_lm, _CLASSES["qwen3_next"].sequence_classification)
