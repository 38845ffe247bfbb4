"""A job that fails in a call every rank raises for prints one clear account: the failing rank's error
once and one line from each other rank, with no MPI_Abort banner and no traceback per rank, under
``python -m mpigpu.average`` and ``python -m mpigpu.run script.py`` (2 and 4 ranks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, mpiexec, run_mpi

BANNERS = ("MPI_Abort", "BAD TERMINATION", "aborting all ranks", "Abort(")

ONE_RANK_REJECTS = """
import numpy as np, mpigpu
from mpigpu.core._mpi import world
rank = world().Get_rank()
x = np.arange(8.0)[::2] if rank == 1 else np.arange(4.0)
mpigpu.allreduce(x)
print("not reached", flush=True)
"""

COUNTS_DIFFER = """
import numpy as np, mpigpu
from mpigpu.core._mpi import world
mpigpu.allreduce(np.ones(4 + world().Get_rank()))
print("not reached", flush=True)
"""


def _run_ended_together(n: int, script: Path) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n n python -m mpigpu.run script``. Run once: the ranks leave in an order in which
    hydra kills none of them (mpigpu.job.leave), so its status-9 banner is a failure here."""
    return run_mpi(n, ["-m", "mpigpu.run", str(script)], timeout=60)


def _no_banner(output: str) -> None:
    for banner in BANNERS:
        assert banner not in output, f"{banner!r} in:\n{output}"


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_rejecting_its_arguments_is_reported_once(tmp_path: Path, n: int) -> None:
    script = tmp_path / "rejects.py"
    script.write_text(textwrap.dedent(ONE_RANK_REJECTS))
    result = _run_ended_together(n, script)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count("InvalidArgument: the array is not contiguous") == 1, output
    assert output.count("Traceback") == 1, output  # the failing rank's own
    others = [line for line in result.stderr.splitlines() if "allreduce did not run: rank 1 rejected" in line]
    assert len(others) == n - 1, output
    assert "not reached" not in output
    _no_banner(output)


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_passing_different_counts_report_it_once(tmp_path: Path, n: int) -> None:
    script = tmp_path / "counts.py"
    script.write_text(textwrap.dedent(COUNTS_DIFFER))
    result = _run_ended_together(n, script)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count("MismatchError: allreduce: ranks passed different arguments") == 1, output
    assert output.count("[mpigpu rank 0] Traceback") == 1 and output.count("Traceback") == 1, output
    assert output.count("stopped by the same MismatchError (printed by rank 0)") == n - 1, output
    _no_banner(output)


def test_average_with_different_sizes_per_rank_reports_it_once() -> None:
    """An MPMD launch whose ranks ask for different sizes: the command's one-line error, once."""
    python = [sys.executable, "-m", "mpigpu.average", "--iters", "1", "--warmup", "0"]
    command = [mpiexec(), "-n", "1", *python, "--size", "1K", ":", "-n", "1", *python, "--size", "2K"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count("error: MismatchError: allreduce: ranks passed different arguments") == 1, output
    assert "[mpigpu rank 1] stopped by the same MismatchError (printed by rank 0)" in output, output
    assert "Traceback" not in output
    _no_banner(output)


@pytest.mark.parametrize("debug", [False, True], ids=["default", "MPIGPU_DEBUG"])
def test_a_mismatch_traceback_ends_at_the_users_own_call(tmp_path: Path, debug: bool) -> None:
    """As NumPy's and torch's errors do: the printed traceback's last frame is the script's line that
    called mpigpu (its internal frames are counted, not shown); MPIGPU_DEBUG=1 shows them all. Both
    under a plain ``python script.py`` and ``python -m mpigpu.run script.py``, 2 ranks."""
    script = tmp_path / "counts.py"
    script.write_text(textwrap.dedent(COUNTS_DIFFER))
    env = {"MPIGPU_DEBUG": "1"} if debug else {}
    for argv in ([str(script)], ["-m", "mpigpu.run", str(script)]):
        result = run_mpi(2, argv, timeout=60, env=env)
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        frames = [line.strip() for line in output.splitlines() if line.strip().startswith("File ")]
        assert frames, output
        if debug:
            assert "mpigpu/job/check.py" in frames[-1] and "frames inside mpigpu" not in output, output
        else:
            assert frames[-1].startswith(f'File "{script}", line 4'), output
            assert all(str(ROOT / "mpigpu") not in f or "run.py" in f or "runpy" in f for f in frames), frames
            assert "frames inside mpigpu not shown: MPIGPU_DEBUG=1 shows them" in output, output
        assert "MismatchError: allreduce: ranks passed different arguments" in output, output
