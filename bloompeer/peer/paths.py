"""Where bloompeer keeps files between runs: the default model, measured throughputs."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """$BLOOMPEER_CACHE, else $XDG_CACHE_HOME/bloompeer, else ~/.cache/bloompeer."""
    if "BLOOMPEER_CACHE" in os.environ:
        return Path(os.environ["BLOOMPEER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bloompeer"
