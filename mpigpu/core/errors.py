"""One error hierarchy: every error mpigpu raises says what was wrong and what to do."""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceError",
    "InvalidArgument",
    "KernelCompileError",
    "MismatchError",
    "MissingDependency",
    "MpigpuError",
    "in_step",
    "install_hint",
    "left_in_step",
]


class MpigpuError(Exception):
    """Base class of every error raised by mpigpu."""


class InvalidArgument(MpigpuError, ValueError):
    """A call's argument cannot work: wrong dtype, layout, shape, size or option value.

    Raised before any data is touched, so the caller's arrays are unchanged."""


class ConfigError(MpigpuError, ValueError):
    """An MPIGPU_* environment variable holds a value that cannot be used."""


class MissingDependency(MpigpuError, ImportError):
    """An optional package (or the MPI library) is needed for this and is not installed."""


def install_hint(extra: str, packages: str) -> str:
    """How to install an extra's packages, in every message that names one: the packages themselves,
    and the extra for a clone of mpigpu (no package index carries mpigpu until it is published)."""
    return f"pip install {packages} (from a clone of mpigpu: pip install '.[{extra}]')"


class BackendUnavailable(MpigpuError):
    """The requested backend cannot run here (library missing, no GPU, MPI not CUDA-aware, ...)."""


class DeviceError(MpigpuError):
    """Rank-to-GPU mapping problems: no GPU for a rank, an array on another GPU, shared GPUs."""


class KernelCompileError(MpigpuError):
    """NVRTC rejected a kernel; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(f"{message}\n--- NVRTC log ---\n{log}" if log else message)
        self.log = log


class MismatchError(MpigpuError):
    """Ranks called the same collective with different arguments.

    Raised on every rank with the same message, naming what differed and where. ``posted``: every
    rank's checked values (mpigpu.job.check's fields, in rank order) when the cross-rank check raised
    it, so a caller can tell what the other ranks asked for (hvd.join's stand-ins read it)."""

    posted: tuple[tuple[int, ...], ...] = ()


class CollectiveTimeout(MpigpuError):
    """A collective did not complete within MPIGPU_TIMEOUT seconds.

    Raised where the timeout is found on a thread that can raise (the ipc kernel's barrier timed
    out); the watchdog, which finds it on its own thread, ends the job with a message of this name."""


def in_step(error: BaseException) -> BaseException:
    """Mark ``error`` as raised by every rank for the same call at the same point, before any data
    moved: the ranks' calls still pair, so a queue of async calls goes on (mpigpu.calls.handles)."""
    error.mpigpu_in_step = True  # type: ignore[attr-defined]
    return error


def left_in_step(error: BaseException) -> bool:
    """Whether every rank raised for this call and the next call still pairs (a cross-rank mismatch,
    or an error marked by ``in_step``)."""
    return isinstance(error, MismatchError) or getattr(error, "mpigpu_in_step", False)
