"""mpigpu.bench.gpu_clock without a GPU (issue 48, goal 4): each step's CUDA event pair (a stand-in event with
a settable clock), the pairing of every method with no communication round by round, the median and spread
that become ``gpu_overhead_s``, the round count against the goal's 30, and the null key with its reason."""

from __future__ import annotations

import pytest

from mpigpu.bench.gpu_clock import MIN_ROUNDS, StepClock, gpu_figures, gpu_lines


class _Event:
    """torch.cuda.Event's part StepClock uses: record() stamps the stand-in clock, elapsed_time in ms."""

    now = 0.0  # ms

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.stamp: float | None = None

    def record(self) -> None:
        self.stamp = _Event.now

    def elapsed_time(self, end: _Event) -> float:
        assert self.stamp is not None and end.stamp is not None
        return end.stamp - self.stamp


def test_the_clock_times_each_step_from_start_to_stop(monkeypatch) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    clock = StepClock()
    for busy, gap in ((4.0, 100.0), (6.5, 3.0)):  # the gap between steps is not counted
        clock.start()
        _Event.now += busy
        clock.stop()
        _Event.now += gap
    assert clock.take() == pytest.approx([0.004, 0.0065])
    assert clock.take() == []  # taken once


def _rounds(count: int) -> dict[str, list[float]]:
    """No communication at 20 ms, with a slow spell every fifth round that falls on every row alike; ddp 3 ms
    over it, the averager 1 ms over it except one round at 2 ms."""
    none = [0.020 + (0.010 if r % 5 == 4 else 0.0) for r in range(count)]
    return {
        "none": none,
        "ddp": [t + 0.003 for t in none],
        "backward_averager": [t + (0.002 if r == 0 else 0.001) for r, t in enumerate(none)],
    }


def test_overhead_is_the_median_of_the_paired_differences_and_their_spread() -> None:
    figures = gpu_figures(_rounds(MIN_ROUNDS))
    overhead = figures["gpu_overhead_s"]
    assert set(overhead) == {"ddp", "backward_averager"}  # every method, not no communication itself
    assert overhead["ddp"]["median"] == pytest.approx(0.003)
    assert overhead["ddp"]["spread"] == pytest.approx([0.003, 0.003])  # the slow spells cancel in the pairs
    assert overhead["backward_averager"]["median"] == pytest.approx(0.001)
    assert overhead["backward_averager"]["spread"] == pytest.approx([0.001, 0.002])
    assert figures["gpu_seconds"]["none"] == pytest.approx(0.020)  # the spells are a minority of rounds
    assert figures["gpu_rounds"] == MIN_ROUNDS and "fewer than" not in figures["gpu_clock"]
    assert figures["gpu_round_seconds"]["ddp"][4] == pytest.approx(0.033)


def test_fewer_rounds_than_the_goal_are_reported_as_such() -> None:
    figures = gpu_figures(_rounds(10))
    assert figures["gpu_rounds"] == 10 and f"fewer than the {MIN_ROUNDS} the goal asks for" in figures["gpu_clock"]


def test_without_a_gpu_the_key_is_null_with_the_reason() -> None:
    assert gpu_figures(None, "no GPU: host clock only") == {
        "gpu_overhead_s": None,
        "gpu_clock": "no GPU: host clock only",
    }


def test_printed_lines_name_each_row_with_its_figures() -> None:
    result = gpu_figures(_rounds(MIN_ROUNDS))
    lines = gpu_lines(result, {"none": "no communication", "ddp": "DDP"})
    assert lines[0].startswith("  GPU clock (CUDA events on the compute stream")
    assert "no communication" in lines[1] and "20.000" in lines[1] and "+" not in lines[1]
    assert "DDP" in lines[2] and "+3.000" in lines[2]
    assert "backward_averager" in lines[3] and "+1.000" in lines[3] and "+2.000" in lines[3]
    assert gpu_lines(gpu_figures(None, "no GPU"), {}) == ["  GPU clock: none (no GPU)"]
