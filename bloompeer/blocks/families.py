"""Every model family bloompeer serves, and which one a checkpoint's config.model_type belongs to."""

from __future__ import annotations

from .bloom import BLOOM
from .family import ModelFamily
from .llama import LLAMA

__all__ = ["FAMILIES", "family_for_model_type", "served_model_types"]

FAMILIES: tuple[ModelFamily, ...] = (BLOOM, LLAMA)


def served_model_types() -> list[str]:
    return [model_type for family in FAMILIES for model_type in family.model_types]


def family_for_model_type(model_type: str) -> ModelFamily:
    """The family of a config.model_type; ValueError naming the served ones for any other."""
    for family in FAMILIES:
        if model_type in family.config_classes:
            return family
    raise ValueError(f"model type {model_type!r} is not served by bloompeer (served: {', '.join(served_model_types())})")

