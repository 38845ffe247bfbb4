"""A stall under pytest's output capture still names the call on the terminal (issue 30: on 2 GPUs the
suite stalled and ended by the timeout's abort with nothing printed: pytest had captured the report)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_mpi

from mpigpu.cli import launcher_rank

pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

STALLING_TEST = """
import time

import numpy as np
from mpi4py import MPI

import mpigpu


def test_rank_1_skips_a_call():
    mpigpu.allreduce(np.ones(4))  # pairs: both ranks
    if MPI.COMM_WORLD.Get_rank() == 0:
        mpigpu.allreduce(np.ones(4))  # rank 1 never makes this call
    else:
        time.sleep(60)
"""


def _stall(tmp_path: Path, *plugin: str) -> str:
    (tmp_path / "test_stall.py").write_text(STALLING_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    done = run_mpi(2, ["-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, "test_stall.py"], timeout=120,
                   cwd=tmp_path, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "MPIGPU_STALL": "1",
                                      "MPIGPU_TIMEOUT": "6", "MPIGPU_ABORT_ON_EXCEPTION": "1"})  # fmt: skip
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_stall_report_and_the_timeout_reach_the_terminal_under_capture(tmp_path: Path) -> None:
    seen = _stall(tmp_path, "-p", "mpigpu.pytest_plugin")
    assert "[mpigpu rank 0] stalled: waiting" in seen and "allreduce" in seen, seen
    assert "CollectiveTimeout" in seen and "MPIGPU_TIMEOUT=6" in seen, seen


def test_without_the_plugin_pytest_swallows_them(tmp_path: Path) -> None:
    """The control: what the plugin changes (pytest keeps descriptor 2 until the test ends, and the job
    ends inside the test)."""
    seen = _stall(tmp_path)
    assert "stalled: waiting" not in seen, seen
