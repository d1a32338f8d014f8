"""Every model family bloompeer serves, which one a checkpoint's config.model_type belongs to, and the
multimodal checkpoints served as their text model."""

from __future__ import annotations

from dataclasses import dataclass

from .bloom import BLOOM
from .family import ModelFamily
from .llama import LLAMA
from .qwen3_next import QWEN3_NEXT

__all__ = ["FAMILIES", "MULTIMODAL_CHECKPOINTS", "TextModelOf", "family_for_model_type", "served_model_types"]

FAMILIES: tuple[ModelFamily, ...] = (BLOOM, LLAMA, QWEN3_NEXT)


@dataclass(frozen=True)
class TextModelOf:
    """A multimodal checkpoint that bloompeer serves as its text model: servers hold the text model's blocks,
    clients its embeddings, final norm and head, and nobody reads the rest (a vision tower, a projector);
    clients refuse images. Its config is the one transformers' config class of the model type nests
    (`get_text_config()`), its tensors are found under the names in `renames`, as transformers'
    conversion_mapping.py renames them for the model type."""

    renames: tuple[tuple[str, str], ...]  # (stored name prefix, the text model's prefix), first match wins


MULTIMODAL_CHECKPOINTS: dict[str, TextModelOf] = {
    # Kimi K2.5: a DeepSeek-V3 text model (text_config, whose "kimi_k2" transformers reads as deepseek_v3), its
    # tensors under language_model.model.* and language_model.lm_head
    "kimi_k25": TextModelOf(renames=(("language_model.", ""),)),
    # Qwen3.5 and Qwen3.5-MoE: qwen3_5_text / qwen3_5_moe_text text models (text_config), their tensors under
    # model.language_model.* beside model.visual.* (and mtp.*), the head at lm_head
    "qwen3_5": TextModelOf(renames=(("model.language_model.", "model."),)),
    "qwen3_5_moe": TextModelOf(renames=(("model.language_model.", "model."),)),
}


def served_model_types() -> list[str]:
    return [model_type for family in FAMILIES for model_type in family.model_types]


def family_for_model_type(model_type: str) -> ModelFamily:
    """The family of a config.model_type; ValueError naming the served ones for any other."""
    for family in FAMILIES:
        if model_type in family.config_classes:
            return family
    served = [*served_model_types(), *(f"{name} (its text model)" for name in MULTIMODAL_CHECKPOINTS)]
    raise ValueError(f"model type {model_type!r} is not served by bloompeer (served: {', '.join(served)})")
