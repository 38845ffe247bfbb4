"""Horovod's error types, and the translation of mpigpu's errors into them.

Horovod raises ``RuntimeError`` subclasses for failed collectives (mismatched shapes, dtypes or
devices across ranks), so scripts catch ``RuntimeError``; mpigpu's errors are translated here into
``HorovodInternalError`` (the original error is its ``__cause__``)."""

from __future__ import annotations

from types import TracebackType

from mpigpu.core.errors import MpigpuError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "horovods", "not_initialized", "translated", "unsupported"]


class HorovodInternalError(RuntimeError):
    """A collective failed: ranks disagreed on its arguments, or the transport failed."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic-training signal. mpigpu has no elastic mode, so it is never raised; it exists so
    that ``except hvd.HostsUpdatedInterrupt`` in a script still compiles."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


def not_initialized() -> ValueError:
    """Horovod's error (a ValueError) for calls made before ``hvd.init()``."""
    return ValueError("Horovod has not been initialized; use hvd.init().")


def unsupported(what: str, instead: str) -> NotImplementedError:
    """The error for a Horovod feature mpigpu does not have, naming what to use instead."""
    return NotImplementedError(f"{what} is not supported by mpigpu.horovod: {instead} (see docs/horovod.md)")


class translated:  # a context manager as a class (lower-case, as contextlib names them): cheaper per call
    """Raise mpigpu's errors met inside as HorovodInternalError (a RuntimeError), message kept."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, MpigpuError):
            raise horovods(self.what, exc) from exc


def horovods(what: str, exc: MpigpuError) -> HorovodInternalError:
    """mpigpu's error ``exc`` in call ``what`` as Horovod's (``translated``'s, for a hot path's own
    ``except``; raise it ``from exc``)."""
    return HorovodInternalError(f"{what}: {type(exc).__name__}: {exc}")
