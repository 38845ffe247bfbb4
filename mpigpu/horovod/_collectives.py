"""The one place that knows which of mpigpu's collectives exist yet.

``mpigpu.reduce_scatter`` and ``mpigpu.alltoall`` (and their async forms) are looked up when a Horovod
call needs them, so this layer imports, and its other calls work, with an mpigpu that lacks them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mpigpu

__all__ = ["collective"]


def collective(name: str) -> Callable[..., Any]:
    """``mpigpu.<name>``, or NotImplementedError (a RuntimeError, as Horovod's errors are) naming it."""
    own = getattr(mpigpu, name, None)
    if own is None:
        raise NotImplementedError(
            f"mpigpu.{name} is not in this mpigpu version ({mpigpu.__version__}), and mpigpu.horovod needs it "
            "for this call: update mpigpu"
        )
    return own
