"""The protocol every allreduce path implements.

A backend is created once per communicator (creation may be collective: an NCCL communicator, a
shared-memory window, CUDA IPC handles) and reused. ``allreduce`` is stream-ordered: it starts after
the work already enqueued on ``stream`` and returns with the output ready in stream order (device
paths) or written (host arrays).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from mpigpu._cuda import StreamRef
    from mpigpu.arrays import ArrayView
    from mpigpu.context import Context
    from mpigpu.dtypes import DType
    from mpigpu.ops import Op

__all__ = ["Availability", "Backend"]


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and why (shown by ``python -m mpigpu.info``)."""

    ok: bool
    reason: str


class Backend(abc.ABC):
    """One allreduce path."""

    name: ClassVar[str]
    code: ClassVar[int]  # stable small integer for the cross-rank signature check
    host_arrays: ClassVar[bool]  # accepts NumPy (host) arrays
    device_arrays: ClassVar[bool]  # accepts CUDA arrays

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.last_phases: dict[str, float] = {}  # per-phase times (us) of the last call, if measured

    @classmethod
    @abc.abstractmethod
    def probe(cls, ctx: Context) -> Availability:
        """Can this backend run on this communicator? Called collectively, once, by every rank."""

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        """None if this backend reduces ``dtype`` with ``op``, else the reason it cannot."""
        return None

    @abc.abstractmethod
    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        """Reduce ``x`` across ranks into ``out`` (which may be ``x`` itself)."""

    def bind(self, x: ArrayView, out: ArrayView, op: Op) -> Callable[[StreamRef | None], None]:
        """``allreduce(x, out, op, stream)`` with all but the stream fixed, for a persistent request
        (mpigpu.persistent). Backends override it to do once what every call would repeat."""
        return partial(self.allreduce, x, out, op)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds (idempotent)."""

    def describe(self) -> dict[str, Any]:
        """Settings worth reporting (chunk size, pool size, ...)."""
        return {}
