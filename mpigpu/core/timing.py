"""Timing: CUDA events on the call's stream for GPU work, barrier-aligned host clocks otherwise,
and the ``Result`` row every command reports (nccl-tests' algbw/busbw conventions)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Result", "busbw_factor", "max_over_ranks", "max_phases_over_ranks", "time_calls"]


def busbw_factor(nranks: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor 2(n-1)/n (0 for one rank)."""
    return 2.0 * (nranks - 1) / nranks if nranks > 1 else 0.0


@dataclass(frozen=True)
class Result:
    """One measured size: time per call (max over ranks), bandwidths and wrong elements."""

    bytes: int
    elements: int
    dtype: str
    op: str
    backend: str
    ranks: int
    time_us: float  # mean time per call on the slowest rank
    wrong: int  # wrong elements summed over all ranks (-1: not checked)
    inplace: bool = True
    median_us: float | None = None  # median over repetitions (slowest rank), when repeated
    spread_us: float | None = None  # max - min over repetitions
    phases_us: dict[str, float] = field(default_factory=dict)  # per-phase times, max over ranks
    per_rank_us: tuple[float, ...] = ()

    @property
    def algbw_gbps(self) -> float:
        return self.bytes / (self.time_us * 1e3) if self.time_us > 0 else 0.0

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * busbw_factor(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["per_rank_us"] = list(self.per_rank_us)
        data["algbw_gbps"] = round(self.algbw_gbps, 4)
        data["busbw_gbps"] = round(self.busbw_gbps, 4)
        return data


def max_over_ranks(comm: Any, value: float) -> tuple[float, tuple[float, ...]]:
    """(max, per-rank values) of a float over the communicator."""
    values = tuple(float(v) for v in comm.allgather(float(value)))
    return max(values), values


def max_phases_over_ranks(comm: Any, phases: dict[str, float]) -> dict[str, float]:
    """Each phase's max over ranks, in one collective. Ranks may report different phases (one
    collective per key would then pair different keys across ranks, or hang)."""
    merged: dict[str, float] = {}
    for theirs in comm.allgather(dict(phases)):
        for name, value in theirs.items():
            merged[name] = max(merged.get(name, 0.0), float(value))
    return dict(sorted(merged.items()))


def time_calls(
    call: Callable[[], Any],
    iters: int,
    *,
    barrier: Callable[[], Any],
    stream: Any = None,
    repeats: int = 1,
) -> list[float]:
    """Mean microseconds per call of ``call``, once per repetition.

    With ``stream`` (a mpigpu StreamRef), CUDA events recorded on it bracket the loop, so the figure
    is the device-side time from the first call's start to the last call's end. Without, a barrier
    aligns the ranks and the host clock brackets the loop (host calls complete before they return).
    """
    means = []
    for _ in range(repeats):
        barrier()
        if stream is not None:
            from mpigpu.core._cuda import timing_event

            start = timing_event(stream)
            for _ in range(iters):
                call()
            end = timing_event(stream)
            end.sync()
            means.append((end - start) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            means.append((time.perf_counter() - t0) * 1e6 / iters)
    return means


def summarize(means: list[float]) -> tuple[float, float, float]:
    """(mean, median, spread) of per-repetition means."""
    return statistics.fmean(means), statistics.median(means), max(means) - min(means)
