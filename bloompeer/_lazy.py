"""Package attributes that import their module on first use (PEP 562).

torch, transformers and hivemind take seconds to import; the command line must answer --help or
refuse a bad flag before that, so packages name their exports here instead of importing them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, namespace: dict, names: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for `package`, whose `names` map to the relative modules defining them;
    a name once loaded is kept in the package's `namespace` (its globals())."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(names) | {name for name in namespace if not name.startswith("_")})

    return __getattr__, __dir__
