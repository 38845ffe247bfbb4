"""Training steps on the GPU's clock (issue 48, goal 4), for mpigpu.bench.training.

Each step is timed with a pair of CUDA events on the compute stream: one recorded before the forward pass
(its first kernel), one after the optimizer step (its last), so a step's time is what the GPU spent from the
one to the other, without the host's gaps between steps (the barrier and the gathers between rounds, Python
between steps). Every method is paired with no communication in the same round: the per-round difference of
the round means (the slowest rank's) is the method's overhead, and the median of those differences over the
rounds, with their spread, is ``gpu_overhead_s``. The goal asks for at least MIN_ROUNDS rounds.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["MIN_ROUNDS", "StepClock", "gpu_figures", "gpu_lines", "paired_overhead", "spread"]

MIN_ROUNDS = 30  # issue 48: at least this many rounds for a GPU-clock overhead


def spread(values: list[float]) -> list[float]:
    """[min, max] of ``values``."""
    return [min(values), max(values)]


def paired_overhead(rounds: dict[str, list[float]], base: str = "none") -> dict[str, list[float]]:
    """Per row, each round's seconds per step minus ``base``'s in the same round: a shared machine's slow
    spell falls on both terms of a difference, so these spread far less than the rows' own times (2 x
    H100, ResNet-50: no communication alone read 22.0 to 32.7 ms over five rounds)."""
    return {row: [t - b for t, b in zip(times, rounds[base], strict=True)] for row, times in rounds.items()}


class StepClock:
    """CUDA event pairs on the current stream, one pair per step: ``start()`` before the step's first kernel,
    ``stop()`` after its last; ``take()`` (after the device is synchronised) gives each step's seconds."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, Any]] = []
        self._started: Any = None

    def start(self) -> None:
        import torch

        self._started = torch.cuda.Event(enable_timing=True)
        self._started.record()

    def stop(self) -> None:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pairs.append((self._started, end))
        self._started = None

    def take(self) -> list[float]:
        """Seconds per step since the last ``take``, in order; the events must have completed."""
        seconds = [start.elapsed_time(end) / 1e3 for start, end in self._pairs]
        self._pairs.clear()
        return seconds


def gpu_figures(rounds: dict[str, list[float]] | None, reason: str | None = None) -> dict[str, Any]:
    """The training JSON's GPU-clock keys from ``rounds`` (per row, each round's mean GPU seconds per step,
    the slowest rank's; "none" is no communication), or, where there were none, ``gpu_overhead_s`` None and
    ``reason``. ``gpu_overhead_s``: per row other than "none", the median over rounds of the paired difference
    to "none" and its [min, max]."""
    if not rounds:
        return {"gpu_overhead_s": None, "gpu_clock": reason or "not measured"}
    count = len(rounds["none"])
    paired = paired_overhead(rounds)
    return {
        "gpu_overhead_s": {
            row: {"median": statistics.median(values), "spread": spread(values)}
            for row, values in paired.items()
            if row != "none"
        },
        "gpu_seconds": {row: statistics.median(values) for row, values in rounds.items()},
        "gpu_round_seconds": rounds,
        "gpu_clock": (
            f"CUDA events on the compute stream, first forward kernel to the optimizer's last, per step; "
            f"{count} rounds" + ("" if count >= MIN_ROUNDS else f" (fewer than the {MIN_ROUNDS} the goal asks for)")
        ),
        "gpu_rounds": count,
    }


def gpu_lines(result: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """The printed table's GPU-clock lines for one model's ``result`` (``labels``: the rows' names)."""
    overhead = result.get("gpu_overhead_s")
    if overhead is None:
        return [f"  GPU clock: none ({result['gpu_clock']})"]
    lines = [f"  GPU clock ({result['gpu_clock']}): ms per step, vs none (median over rounds), min-max"]
    for row, seconds in result["gpu_seconds"].items():
        versus = ""
        if row in overhead:  # every row but no communication itself
            (low, high), median = overhead[row]["spread"], overhead[row]["median"]
            versus = f" {median * 1e3:+9.3f} {low * 1e3:+8.3f}/{high * 1e3:<+8.3f}"
        lines.append(f"    {labels.get(row, row):<36} {seconds * 1e3:9.3f}{versus}")
    return lines
