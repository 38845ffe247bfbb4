"""Several host devices per process, in jobs these tests start (serial: they launch mpiexec themselves).

The same bits whatever the layout: the 'cpu' path reduces every participant's rows in participant
order, so 1 rank x 2 devices and 2 ranks x 1 device (and 4 x 1, 2 x 2, 1 x 4, 3 + 1 for four
participants) give the very bits of one NumPy fold in participant order, on inputs whose sums round
(the verifier's seed pattern). And two communicators first used at once by two threads must not hang.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from conftest import run_mpi
from multi_devices_job import COUNT, DTYPES, OPS, STEPS

from mpigpu.cli import launcher_rank
from mpigpu.core._cuda import visible_device_count
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill

ON_GPUS = "host devices: a process with a GPU drives GPUs (tests/gpu/test_per_process_gpu.py covers those)"
pytestmark = [
    pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself"),
    pytest.mark.skipif(visible_device_count() > 0, reason=ON_GPUS),
]

JOB = Path(__file__).with_name("multi_devices_job.py")

LAYOUTS = ["2", "1,1", "4", "2,2", "1,1,1,1", "3,1"]


def _fold(dtype: str, op: str, total: int) -> str:
    """One NumPy fold in participant order, with mpigpu's host semantics: half types accumulate in
    float32 and round once; avg divides the sum by the participants in the accumulator type."""
    rows = []
    for p in range(total):
        x = np.empty(COUNT, dtype)
        fill(x, "seed", Op(op), p, total)
        rows.append(x)
    acc_type = np.float32 if dtype == "float16" else np.dtype(dtype)
    acc = rows[0].astype(acc_type)
    for row in rows[1:]:
        acc = acc + row.astype(acc_type)
    if op == "avg":
        acc = acc / acc.dtype.type(total)
    return hashlib.sha256(acc.astype(dtype).tobytes()).hexdigest()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_bits_whatever_the_layout(layout: str) -> None:
    _same_bits(layout)


@pytest.mark.parametrize(("layout", "hosts"), [("1,2,2,1", "nodeA:2,nodeB:2"), ("2,1,3", "nodeA:2,nodeB:1")])
def test_same_bits_across_mpi_nodes(layout: str, hosts: str) -> None:
    """Issue 45: several devices per process on MPI's own nodes (MPICH's fork launcher with named hosts)."""
    _same_bits(layout, hosts)


def _same_bits(layout: str, hosts: str | None = None) -> None:
    counts = [int(n) for n in layout.split(",")]
    total = sum(counts)
    done = run_mpi(len(counts), [str(JOB), "bits", layout], timeout=120, hosts=hosts)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    got: dict[tuple[str, str, int], str] = {}
    for line in done.stdout.splitlines():
        if line.startswith("digest "):
            _, dtype, op, p, digest = line.split()
            got[(dtype, op, int(p))] = digest
    assert sorted(got) == sorted((d, o, p) for d in DTYPES for o in OPS for p in range(total)), output
    for dtype in DTYPES:
        for op in OPS:
            want = _fold(dtype, op, total)
            wrong = [p for p in range(total) if got[(dtype, op, p)] != want]
            assert not wrong, f"{dtype} {op}: participants {wrong} differ from the fold in participant order"


def test_two_communicators_first_used_by_two_threads_at_once_do_not_hang() -> None:
    """Each communicator has its own thread (what mpigpu's one-thread rule recommends); rank 0 makes its
    first call on A, then on B; the other ranks on B, then on A. Both calls must complete."""
    done = run_mpi(2, [str(JOB), "two-comms"], timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "ok 0" in done.stdout and "ok 1" in done.stdout, output


@pytest.mark.parametrize("order", ["1,0", "0,1"], ids=["failed-device-first", "sibling-first"])
@pytest.mark.parametrize("n", [1, 2])
def test_after_one_failed_step_the_next_steps_run(tmp_path: Path, n: int, order: str) -> None:
    """The usage guide's pattern, a fresh thread per device for each step: in step 1 rank 0's device 1
    leaves its block by an exception before its call. That step raises on every participant. Steps 2 and
    3 give exact sums everywhere, whichever device's thread starts first: the MismatchError that device
    0's call raised in step 1 (already raised on every participant) must not fail device 0's later calls
    in turn, and device 0's next-step call, made before device 1's new block begins, waits for it
    (sibling-first: before the fix it raised a stale MismatchError and the steps after it hung)."""
    done = run_mpi(n, [str(JOB), "steps", str(tmp_path), order], timeout=120)
    output = done.stdout + done.stderr
    seen = {r: (tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(n)
            if (tmp_path / f"rank{r}.txt").exists()}  # fmt: skip
    assert done.returncode == 0, f"{seen}\n{output}"
    for rank in range(n):
        lines = seen[rank]
        assert lines[-1] == "done", lines
        results = {tuple(line.split()[:2]): line.split(maxsplit=2)[2] for line in lines[:-1]}
        for step in range(STEPS):
            for k in range(2):
                got = results.get((str(step), str(k)))
                if step != 1:
                    want = "ok"
                elif (rank, k) == (0, 1):
                    want = "RuntimeError"
                else:
                    want = "MismatchError"
                assert got == want, f"rank {rank}, step {step}, device {k}: {got} (expected {want}); {seen}"
