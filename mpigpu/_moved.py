"""Module paths that earlier docs and samples showed and the 2026-11-25 layout moved (issue 30).

Each old path is a small module that calls ``moved``: importing it works, with a DeprecationWarning
naming the new import, and its names are read from the new module when first used."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["moved"]


def moved(old: str, *new: str, use: str = "") -> Callable[[str], Any]:
    """Warn, at the import of ``old``, that it is now ``new``; return the module ``__getattr__``
    that finds each name in the new modules, in order. ``use``: the import to write instead."""
    instead = use or f"import from {' or '.join(new)}"
    warnings.warn(
        f"{old} moved to {' and '.join(new)}: {instead}. The old path is kept so that programs written against "
        "earlier documentation keep working.",
        DeprecationWarning,
        stacklevel=3,  # the import statement (the warnings module skips importlib's own frames)
    )

    def find(name: str) -> Any:
        for module in new:
            value = getattr(importlib.import_module(module), name, _MISSING)
            if value is not _MISSING:
                return value
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {' and '.join(new)})")

    return find


_MISSING = object()
