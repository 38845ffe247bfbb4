"""MPIGPU_* environment variables, parsed and validated in one place.

A bad value is a ``ConfigError`` naming the variable, the value and what is accepted; it is never
silently ignored.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mpigpu.core.errors import ConfigError, InvalidArgument

__all__ = [
    "AGREED",
    "DEFAULT_STALL_S",
    "DEFAULT_TIMEOUT_S",
    "ENV_VARS",
    "INT_RANGES",
    "MAX_TIMEOUT_S",
    "Settings",
    "disagreement",
    "parse_count",
    "settings",
    "size_label",
]

# MPIGPU_TIMEOUT's upper bound: the ipc kernels count it in nanoseconds in a 64-bit integer (2**64 ns
# is 584 years; 2e10 s and more overflow it). 1e6 s (11.6 days) is longer than any job's step.
MAX_TIMEOUT_S = 1e6
DEFAULT_TIMEOUT_S = 600.0  # torch.distributed's default: a hang ends the job, with a message, in 10 minutes
DEFAULT_STALL_S = 60.0  # Horovod's stall check waits as long before it reports

# name -> one-line description (used by --help texts, info and the README)
ENV_VARS: dict[str, str] = {
    "MPIGPU_CUDA_AWARE": "0 or 1: override CUDA-awareness detection of the MPI library",
    "MPIGPU_NODE_SIZE": "N: split each node into virtual nodes of N ranks (runs the multi-node code on one machine)",
    "MPIGPU_TIMEOUT": "seconds, at most 1e6: abort the job if a collective has not completed in time "
    f"(default {DEFAULT_TIMEOUT_S:g}; 0 = off)",
    "MPIGPU_STALL": "seconds: a rank waiting this long in a collective prints which call it waits in and which "
    f"ranks have not reached it (default {DEFAULT_STALL_S:g}; 0 = off)",
    "MPIGPU_CHECK": "1 (default) or 0: check on every call that all ranks pass the same count, dtype, op and backend",
    "MPIGPU_ABORT_ON_EXCEPTION": "1 (default) or 0: an uncaught exception or sys.exit(n != 0) on one rank aborts the "
    "whole job (from `import mpigpu` on, once MPI runs with more than one rank) instead of leaving the other ranks "
    "waiting",
    "MPIGPU_ALLOW_SHARED_GPU": "1: allow more ranks on a node than visible GPUs (ranks then share GPUs)",
    "MPIGPU_DEVICES_PER_RANK": "N: devices each process drives with mpigpu.on_device or a list call (default: its "
    "node's visible GPUs divided among the node's ranks, at least 1; on a machine with no GPU: N host devices "
    "holding NumPy arrays, default 1)",
    "MPIGPU_HOST_POOL_MB": "MiB: cap on the host path's pinned staging memory per rank (default 1024)",
    "MPIGPU_HOST_CHUNK": "bytes (e.g. 4M): the host path's pipeline chunk (default 4 MiB on GPUs, 16 MiB for NumPy)",
    "MPIGPU_HOST_DEPTH": "N: chunks the host path's pipeline stages ahead of the reduction (default 2)",
    "MPIGPU_HOST_SMALL": "bytes: messages up to this size take the host path's latency route (default 64K)",
    "MPIGPU_TUNE_FILE": "path: crossover table written by `mpigpu.bench --tune` and read by backend='auto'",
    "MPIGPU_CACHE_DIR": "directory: compiled-kernel cache (default ~/.cache/mpigpu)",
    "MPIGPU_LOG": "1: print to stderr (rank 0) which backend 'auto' picked and why, once per choice",
    "MPIGPU_DEBUG": "1: an uncaught mpigpu error's traceback keeps mpigpu's own frames (default: it ends at your call)",
    "MPIGPU_TIMELINE": "directory: every rank records its collective calls and training buckets to "
    "<directory>/rank<r>.json (created 0700; merge with `python -m mpigpu.timeline merge`); unset: off, at no cost",
    "MPIGPU_TIMELINE_EVENTS": "N: events each rank keeps for the timeline, the oldest dropped first (default 100000)",
    "MPIGPU_JAX_HANDLER": "auto (default), compiled or python: which FFI handler runs mpigpu.jax's collectives in "
    "compiled programs. auto: the compiled one (built with the C++ compiler at first use, cached like the kernels) "
    "where it takes the call, else the Python one; compiled: refuse a call it cannot take; python: never compile",
    "MPIGPU_BOARD_HANDLER": "auto (default) or python: where the check board runs the cross-rank check and tiny "
    "host allreduces. auto: in mpigpu's compiled helper (built with the C compiler at first use, cached like the "
    "kernels) where it builds, else in Python; python: never compile. Per rank: both give the same bits",
    "MPIGPU_JAX_ORDER": "auto (default) or tokens: how mpigpu.jax's calls in compiled programs stay in order. auto: "
    "GPU programs in launch order and XLA's schedule, with no JAX effect (JAX's fast dispatch); CPU programs by a "
    "token. tokens: a token everywhere (ranks whose XLA might schedule one program differently: unlike GPUs)",
}

# name -> (smallest, largest) value of each integer setting. Every value is checked against its range
# before anything uses it: a value past it (say 2**63, which no int64 holds) is a ConfigError naming the
# variable, on every rank alike, never an OverflowError on one rank.
INT_RANGES: dict[str, tuple[int, int]] = {
    "MPIGPU_NODE_SIZE": (1, (1 << 31) - 1),  # ranks: MPI counts them in a C int
    "MPIGPU_DEVICES_PER_RANK": (0, 1 << 10),  # devices in one process: far more than any node holds (0: default)
    "MPIGPU_HOST_POOL_MB": (1, 1 << 30),  # 1 PiB per rank: above any node's memory; its bytes fit an int64
    "MPIGPU_HOST_CHUNK": (1, 1 << 50),  # bytes: 1 PiB
    "MPIGPU_HOST_DEPTH": (1, 1 << 20),  # chunks ahead: far more than any pool holds
    "MPIGPU_HOST_SMALL": (0, 1 << 50),  # bytes: 1 PiB
    "MPIGPU_TIMELINE_EVENTS": (1, 1 << 28),  # ~50 GiB of events: past any useful trace
}

# the variables of Settings.agreed(), in its order
AGREED = (
    "MPIGPU_CHECK",
    "MPIGPU_NODE_SIZE",
    "MPIGPU_CUDA_AWARE",
    "MPIGPU_ALLOW_SHARED_GPU",
    "MPIGPU_HOST_POOL_MB",
    "MPIGPU_HOST_CHUNK",
    "MPIGPU_HOST_DEPTH",
    "MPIGPU_HOST_SMALL",
    "MPIGPU_TIMELINE",
)

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MAX_DIGITS = 30  # longer numbers are refused before int() reads them (Python limits int() to 4300 digits)


def parse_count(text: str | int, *, what: str = "size", allow_zero: bool = False) -> int:
    """Parse ``1000``, ``4K``, ``64M``, ``1G``, ``2MiB`` (binary multiples) into a positive int."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
        if not match:
            raise InvalidArgument(
                f"invalid {what} {text!r}: give a whole number, optionally with K, M or G (e.g. 4K, 1M, 64M)"
            )
        if len(match.group(1).lstrip("0")) > _MAX_DIGITS:
            raise InvalidArgument(f"invalid {what} {str(text)[:40]!r}...: more than {_MAX_DIGITS} digits")
        value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidArgument(f"invalid {what} {text!r}: it must be {'>= 0' if allow_zero else '> 0'}")
    return value


def size_label(nbytes: int) -> str:
    """``8 B``, ``4 KiB``, ``1.5 MiB``: sizes as tables and ``info`` show them (``parse_count`` reads them)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            value = nbytes / (1 << shift)
            return f"{value:g} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def _bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not valid: use 1 or 0")


def _word(name: str, choices: tuple[str, ...], default: str) -> str:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise ConfigError(f"{name}={value!r} is not valid: use {', '.join(choices)}")
    return value.lower()


def _opt_bool(name: str) -> bool | None:
    return None if _raw(name) is None else _bool(name, False)


def _count(name: str, default: int | None) -> int | None:
    """An integer setting (``4K`` and the like allowed), checked against its range in INT_RANGES."""
    value = _raw(name)
    if value is None:
        return default
    low, high = INT_RANGES[name]
    try:
        number = parse_count(value, what=name, allow_zero=True)
    except InvalidArgument:
        number = None
    if number is None or not low <= number <= high:
        shown = value if len(value) <= 40 else f"{value[:40]}..."
        raise ConfigError(f"{name}={shown!r} is not valid: give a whole number from {low} to {high}; {ENV_VARS[name]}")
    return number


def _seconds(name: str, default: float) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_TIMEOUT_S:  # also refuses nan and inf
        raise ConfigError(f"{name}={value!r} is not valid: {ENV_VARS[name]}")
    return seconds


def _user_path(name: str, value: str) -> Path:
    """``value`` with ``~`` expanded, or a ConfigError naming ``name`` (pathlib raises a bare RuntimeError)."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        raise ConfigError(
            f"{name}={value!r} is not valid: its '~' names no user with a home directory here; give an absolute path"
        ) from None


def _cache_dir() -> Path:
    """MPIGPU_CACHE_DIR, else $XDG_CACHE_HOME/mpigpu, else ~/.cache/mpigpu; where this user has no home
    (no HOME and no password entry: some containers) a directory of this user's in the temporary
    directory, which privatefs uses only if it is ours and private."""
    value = _raw("MPIGPU_CACHE_DIR")
    if value:
        return _user_path("MPIGPU_CACHE_DIR", value)
    base = _raw("XDG_CACHE_HOME")
    if base:
        return Path(base) / "mpigpu"
    try:
        return Path.home() / ".cache" / "mpigpu"
    except RuntimeError:
        return Path(tempfile.gettempdir()) / f"mpigpu-cache-{os.geteuid()}"


@dataclass(frozen=True)
class Settings:
    """A snapshot of the MPIGPU_* variables (read when a communicator is first used)."""

    cuda_aware: bool | None = None
    node_size: int | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    stall: float = DEFAULT_STALL_S
    check: bool = True
    abort_on_exception: bool = True
    allow_shared_gpu: bool = False
    devices_per_rank: int = 0  # 0: the default (see ENV_VARS)
    host_pool_bytes: int = 1024 << 20
    host_chunk: int | None = None
    host_depth: int = 2
    host_small: int = 64 << 10
    cache_dir: Path = field(default_factory=_cache_dir)
    tune_file: Path | None = None
    log: bool = False
    debug: bool = False  # MPIGPU_DEBUG: full tracebacks (per rank: it only changes what is printed)
    timeline: Path | None = None  # MPIGPU_TIMELINE: on where set (agreed: the clock exchange is collective)
    timeline_events: int = 100_000
    jax_handler: str = "auto"  # MPIGPU_JAX_HANDLER (per rank: the ranks agree per call while compiling)
    jax_order: str = "auto"  # MPIGPU_JAX_ORDER
    board_handler: str = "auto"  # MPIGPU_BOARD_HANDLER (per rank: the two paths pair, bit for bit)

    def agreed(self) -> tuple[tuple[str, object], ...]:
        """(variable, value) of the settings that change which collectives run, or which backend is
        chosen: they must be equal on every rank (checked when a communicator is first used).
        Per-rank on purpose: MPIGPU_DEVICES_PER_RANK (ranks may drive different numbers of devices),
        MPIGPU_TIMEOUT, MPIGPU_STALL and MPIGPU_ABORT_ON_EXCEPTION (how this rank
        reacts to a failure), MPIGPU_LOG, MPIGPU_CACHE_DIR, MPIGPU_TUNE_FILE (rank 0 reads the table, then
        broadcasts it), MPIGPU_TIMELINE_EVENTS. Of MPIGPU_TIMELINE only whether it is set is agreed (its
        start-up exchanges clocks; the directory may differ per node)."""
        values = (
            int(self.check),
            self.node_size,
            None if self.cuda_aware is None else int(self.cuda_aware),
            int(self.allow_shared_gpu),
            self.host_pool_bytes >> 20,
            self.host_chunk,
            self.host_depth,
            self.host_small,
            None if self.timeline is None else 1,
        )
        return tuple(zip(AGREED, values, strict=True))

    @property
    def tune_path(self) -> Path:
        return self.tune_file or self.cache_dir / "tune.json"

    @classmethod
    def from_env(cls) -> Settings:
        tune = _raw("MPIGPU_TUNE_FILE")
        timeline = _raw("MPIGPU_TIMELINE")
        events = _count("MPIGPU_TIMELINE_EVENTS", 100_000)
        assert events is not None
        pool_mb = _count("MPIGPU_HOST_POOL_MB", 1024)
        depth = _count("MPIGPU_HOST_DEPTH", 2)
        small = _count("MPIGPU_HOST_SMALL", 64 << 10)
        assert pool_mb is not None and depth is not None and small is not None
        return cls(
            cuda_aware=_opt_bool("MPIGPU_CUDA_AWARE"),
            node_size=_count("MPIGPU_NODE_SIZE", None),
            timeout=_seconds("MPIGPU_TIMEOUT", DEFAULT_TIMEOUT_S),
            stall=_seconds("MPIGPU_STALL", DEFAULT_STALL_S),
            check=_bool("MPIGPU_CHECK", True),
            abort_on_exception=_bool("MPIGPU_ABORT_ON_EXCEPTION", True),
            allow_shared_gpu=_bool("MPIGPU_ALLOW_SHARED_GPU", False),
            devices_per_rank=_count("MPIGPU_DEVICES_PER_RANK", 0) or 0,
            host_pool_bytes=pool_mb << 20,
            host_chunk=_count("MPIGPU_HOST_CHUNK", None),
            host_depth=depth,
            host_small=small,
            cache_dir=_cache_dir(),
            tune_file=_user_path("MPIGPU_TUNE_FILE", tune) if tune else None,
            log=_bool("MPIGPU_LOG", False),
            debug=_bool("MPIGPU_DEBUG", False),
            timeline=_user_path("MPIGPU_TIMELINE", timeline) if timeline else None,
            timeline_events=events,
            jax_handler=_word("MPIGPU_JAX_HANDLER", ("auto", "compiled", "python"), "auto"),
            jax_order=_word("MPIGPU_JAX_ORDER", ("auto", "tokens"), "auto"),
            board_handler=_word("MPIGPU_BOARD_HANDLER", ("auto", "python"), "auto"),
        )


def disagreement(per_rank: list[tuple[tuple[str, object], ...]]) -> str | None:
    """None if every rank has the same ``Settings.agreed()``, else a message (the same on every rank)
    naming each variable that differs and its value per rank."""
    parts = []
    for index, (name, _) in enumerate(per_rank[0]):
        by_value: dict[object, list[int]] = {}
        for rank, values in enumerate(per_rank):
            by_value.setdefault(values[index][1], []).append(rank)
        if len(by_value) > 1:
            shown = "; ".join(
                f"{'unset' if v is None else v} on rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}"
                for v, r in by_value.items()
            )
            parts.append(f"{name}: {shown}")
    if not parts:
        return None
    return (
        f"settings differ between ranks ({' | '.join(parts)}). These change which collectives mpigpu runs, so "
        "every rank must have the same value: set them alike in the environment of every rank."
    )


def settings() -> Settings:
    """Read and validate the environment now."""
    return Settings.from_env()
