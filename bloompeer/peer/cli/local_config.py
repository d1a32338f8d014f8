"""What a local checkpoint's config.json says, read without importing torch or transformers:
for checks that must answer at once (flags) and plans made before any model is loaded (a local
swarm's split of the blocks)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["local_num_model_blocks"]


def local_num_model_blocks(model: str | Path) -> int | None:
    """The number of blocks in `model`'s config.json (its text model's), or None if it is not a local directory
    with one (a hub name), or the file does not say."""
    config_file = Path(model).expanduser() / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if isinstance(config.get("text_config"), dict):  # multimodal, served as its text model (Kimi K2.5, Qwen3.5)
        config = config["text_config"]
    num_model_blocks = config.get("n_layer", config.get("num_hidden_layers"))
    return num_model_blocks if isinstance(num_model_blocks, int) else None
