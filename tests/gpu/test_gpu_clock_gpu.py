"""mpigpu.bench.gpu_clock's CUDA event pairs on a real GPU (issue 48, goal 4), on every rank of the launch: a
step's time is the GPU's work between its start and stop (a kernel that spins a known number of cycles), and
the host's pause between two steps is not counted."""

from __future__ import annotations

import time

import pytest

from mpigpu.bench.gpu_clock import StepClock

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]


def test_each_step_is_its_gpu_work_and_not_the_host_gap(ctx) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    torch.cuda.set_device(ctx.gpu.index)
    cycles = 10_000_000  # 5 ms at 2 GHz, 10 ms at 1 GHz
    clock = StepClock()
    clock.start()
    torch.cuda._sleep(cycles)
    clock.stop()
    torch.cuda.synchronize()
    time.sleep(0.05)  # the host away between steps: 50 ms that must not count
    clock.start()
    clock.stop()
    torch.cuda.synchronize()
    busy, empty = clock.take()
    assert 2e-3 < busy < 0.05, busy  # the spin, within a loose band of a boost or throttled clock
    assert 0 <= empty < 1e-3, empty
    assert clock.take() == []
