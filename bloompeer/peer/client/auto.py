"""from_pretrained for any served checkpoint: the client class of its family, as transformers'
AutoModelForCausalLM picks the class of a model type."""

from __future__ import annotations

from ...blocks import open_checkpoint
from .families import ClientClasses, client_classes

__all__ = ["AutoDistributedModelForCausalLM", "AutoDistributedModelForSequenceClassification"]


class _AutoDistributedModel:
    @staticmethod
    def _pick(classes: ClientClasses) -> type:
        raise NotImplementedError

    def __init__(self):
        raise TypeError(f"{type(self).__name__} is not instantiated: use {type(self).__name__}.from_pretrained(...)")

    @classmethod
    def class_for(cls, name_or_path: str, revision: str | None = None, cache_dir: str | None = None) -> type:
        """The client class of the checkpoint's family (reads only its config.json)."""
        return cls._pick(client_classes(open_checkpoint(name_or_path, revision, cache_dir).family.name))

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs):
        """The family class's from_pretrained (see DistributedModelMixin.from_pretrained for the arguments)."""
        family_class = cls.class_for(name_or_path, kwargs.get("revision"), kwargs.get("cache_dir"))
        return family_class.from_pretrained(name_or_path, **kwargs)


class AutoDistributedModelForCausalLM(_AutoDistributedModel):
    @staticmethod
    def _pick(classes: ClientClasses) -> type:
        return classes.causal_lm


class AutoDistributedModelForSequenceClassification(_AutoDistributedModel):
    @staticmethod
    def _pick(classes: ClientClasses) -> type:
        return classes.sequence_classification
