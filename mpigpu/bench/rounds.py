"""The interleaved timing of one size: every path timed in turn, in rounds (issue 31).

On a shared machine the load changes from one second to the next. Paths timed one after another's
whole sweep meet different machines, and the ratios of one run do not hold (a newcomer saw ``cpu``
9.8x faster than the MPI call it wraps). So at each size the paths take turns: round ``r`` times
the ``k`` paths in their listed order rotated to start at path ``r mod k`` (none is always first),
each turn a warm-up, a stream synchronisation and ``iters`` timed calls (``calls.time_turn``), and
``R`` rounds are run. A path's figure is the median over rounds of the round's time per call on the
slowest rank: a burst of load spoils one round of every path, not every figure of one path.

Collective: every rank plays the same turns in the same order with the same counts (the sweep
agrees the counts first: its calibration takes the max over ranks).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpigpu.bench.calls import Bound, time_turn
from mpigpu.bench.report import PathSpec

__all__ = ["Figures", "Turn", "figures", "play", "rotation", "run_rounds"]


@dataclass
class Turn:
    """One path's part in the rounds of one size, and what its turns measured on this rank."""

    path: PathSpec
    bound: Bound
    iters: int = 1  # timed calls per turn (the same on every rank)
    warmup: int = 0  # untimed calls before them, per turn
    phases: Callable[[], dict[str, float]] | None = None  # the backend's last_phases, read after each turn
    samples: list[list[float]] = field(default_factory=list)  # per round: us per call, this rank
    seconds: float = 0.0  # this rank's wall time for the path at this size (its check included)
    last_phases: dict[str, float] = field(default_factory=dict)


def rotation(k: int, r: int) -> list[int]:
    """The order of ``k`` paths in round ``r``: the listed order, starting at path ``r mod k``."""
    start = r % k if k else 0
    return [*range(start, k), *range(start)]


def play(turn: Turn, *, timing: str, sync: Callable[[], Any], barrier: Callable[[], Any]) -> None:
    """One turn: the warm-up, a synchronisation (so the timed calls do not wait for the warm-up's
    device work), then the timed calls; their samples are appended to ``turn.samples``."""
    started = time.perf_counter()
    for _ in range(turn.warmup):
        turn.bound.call()
    sync()
    turn.samples.append(time_turn(turn.bound.call, sync, barrier, iters=turn.iters, timing=timing))
    if turn.phases is not None:
        turn.last_phases = dict(turn.phases())
    turn.seconds += time.perf_counter() - started


def run_rounds(
    turns: list[Turn], rounds: int, *, timing: str, sync: Callable[[], Any], barrier: Callable[[], Any]
) -> None:
    """``rounds`` rounds of every turn, each round in its rotated order (collective)."""
    for r in range(rounds):
        for i in rotation(len(turns), r):
            play(turns[i], timing=timing, sync=sync, barrier=barrier)


@dataclass(frozen=True)
class Figures:
    """One path's figures over ranks: ``rounds_us`` is each round's time per call on the slowest
    rank, ``median_us`` their median and ``spread_us`` their max - min; ``time_us`` the mean per call
    over every sample on the slowest rank (``per_rank_us``: each rank's); ``seconds`` the slowest
    rank's wall time for the path."""

    time_us: float
    median_us: float
    spread_us: float
    per_rank_us: tuple[float, ...]
    rounds_us: tuple[float, ...]
    seconds: float


def figures(comm: Any, turns: list[Turn]) -> list[Figures]:
    """Each turn's Figures (``turns``: not empty, every round played), from every rank's samples in
    one typed Allgather (collective)."""
    from mpigpu.core._mpi import MPI

    rounds = len(turns[0].samples)
    mine = np.array(
        [[statistics.fmean(s for rnd in t.samples for s in rnd), t.seconds, *map(statistics.median, t.samples)]
         for t in turns],
        np.float64,
    ).reshape(len(turns), rounds + 2)  # fmt: skip
    everyone = np.empty((comm.Get_size(), *mine.shape), np.float64)
    double = MPI().DOUBLE
    comm.Allgather([mine, double], [everyone, double])
    found = []
    for i in range(len(turns)):
        per_round = tuple(float(v) for v in everyone[:, i, 2:].max(axis=0))
        per_rank = tuple(float(v) for v in everyone[:, i, 0])
        spread = max(per_round) - min(per_round)
        seconds = float(everyone[:, i, 1].max())
        found.append(Figures(max(per_rank), statistics.median(per_round), spread, per_rank, per_round, seconds))
    return found
