"""The watchdog with several devices per process (serial: each test launches its own job).

Two ranks, two host devices each (MPIGPU_DEVICES_PER_RANK=2), a thread per device; rank 1's device 1
never makes the call. With MPIGPU_STALL=1 the stall report names the missing (rank, device) pair, and
MPIGPU_TIMEOUT=8 ends the job (non-zero) well before the launch limit; both reach the output.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import run_mpi

from mpigpu.cli import launcher_rank
from mpigpu.core._cuda import visible_device_count

ON_GPUS = "host devices: a process with a GPU drives GPUs (tests/gpu/test_per_process_gpu.py covers those)"
pytestmark = [
    pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself"),
    pytest.mark.skipif(visible_device_count() > 0, reason=ON_GPUS),
]

TIMEOUT_S = 8
ENV = {"MPIGPU_STALL": "1", "MPIGPU_TIMEOUT": str(TIMEOUT_S), "MPIGPU_DEVICES_PER_RANK": "2"}
END_WITHIN_S = 45  # start-up, the timeout, the abort: far below the launch limit

STALLER = """
import sys, threading, time
import numpy as np
from mpi4py import MPI
import mpigpu

before = int(sys.argv[1])  # calls every device makes before rank 1's device 1 stops calling
rank = MPI.COMM_WORLD.Get_rank()
assert mpigpu.local_devices() == [0, 1]


def device(k):
    with mpigpu.on_device(k):
        for _ in range(before):
            mpigpu.allreduce(np.ones(4, np.float32), "sum")
        if rank == 1 and k == 1:
            time.sleep(120)  # never makes the next call
            return
        mpigpu.allreduce(np.ones(4, np.float32), "sum")


threads = [threading.Thread(target=device, args=(k,), daemon=True) for k in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


def _stall(tmp_path: Path, before: int) -> tuple[str, float, int]:
    script = tmp_path / "staller.py"
    script.write_text(STALLER)
    start = time.monotonic()
    done = run_mpi(2, [str(script), str(before)], timeout=120, env=ENV)
    return done.stdout + done.stderr, time.monotonic() - start, done.returncode


def _stalled(output: str, rank: int) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"[mpigpu rank {rank}] stalled:")]


@pytest.mark.parametrize("before", [0, 2], ids=["first call", "third call"])
def test_a_device_that_never_calls_is_named_and_the_job_ends(tmp_path: Path, before: int) -> None:
    output, elapsed, code = _stall(tmp_path, before)
    assert code != 0, output
    assert elapsed < END_WITHIN_S, f"took {elapsed:.1f} s\n{output}"
    lines = _stalled(output, 1)
    assert any("waiting for (rank 1, host device 1) to make this call" in line for line in lines), output
    assert any(f"allreduce #{before} over several devices per process" in line for line in lines), output
    assert "(rank 1, host device 0)" not in output, output  # it did make the call
    assert "CollectiveTimeout" in output and f"MPIGPU_TIMEOUT={TIMEOUT_S}" in output, output


def test_the_stall_report_after_earlier_calls_does_not_claim_start_up(tmp_path: Path) -> None:
    """After two calls over the devices have completed, the report must not say the communicator is in
    its start-up (mpigpu call 0): that hides which ranks have reached the call."""
    output, _, code = _stall(tmp_path, 2)
    assert code != 0, output
    lines = _stalled(output, 0) + _stalled(output, 1)
    assert lines, output
    wrong = [line for line in lines if "(start-up)" in line]
    assert not wrong, "\n".join(wrong)
