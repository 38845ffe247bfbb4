"""``python -m mpigpu.average`` at the edges a new user meets: a size the node cannot hold is refused
up front with what it needs and what there is (not a MemoryError from every rank), and --no-check
does not claim a PASS it did not verify."""

from __future__ import annotations

import pytest
from conftest import run_mpi


@pytest.mark.parametrize("n", [2, 4])
def test_a_size_that_cannot_fit_is_refused_with_the_numbers(n: int) -> None:
    done = run_mpi(n, ["-m", "mpigpu.average", "--size", "1T", "--device", "cpu"], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr  # one line for the job, not one per rank
    assert "--size needs 4096 GiB of host memory per rank" in lines[0], lines[0]
    assert "available: give a smaller --size" in lines[0], lines[0]
    assert "MemoryError" not in done.stderr and "Traceback" not in done.stderr


def test_no_check_says_nothing_was_verified() -> None:
    done = run_mpi(2, ["-m", "mpigpu.average", "--size", "1K", "--iters", "2", "--warmup", "0", "--no-check"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# NOT VERIFIED (--no-check)" in done.stdout, done.stdout
    assert "PASS" not in done.stdout, done.stdout
    checked = run_mpi(2, ["-m", "mpigpu.average", "--size", "1K", "--iters", "2", "--warmup", "0"])
    assert checked.returncode == 0 and "# PASS: 0 wrong elements over 2 ranks" in checked.stdout, checked.stdout
