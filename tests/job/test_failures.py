"""One rank failing must end the whole job, quickly, with that rank's message and a non-zero exit
status: exceptions (under ``python -m mpigpu.run``, in mpigpu's commands, in plain scripts once
mpigpu has started), ``sys.exit``, signals, MPIGPU_TIMEOUT, invalid settings and options, also when
only one rank of an MPMD launch gets them. Each test starts its own mpiexec with a time limit and
asserts the elapsed time, the exit status and the message."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT, outside_job_env, run_mpi

from mpigpu.core.config import ENV_VARS, INT_RANGES, Settings
from mpigpu.core.errors import ConfigError

END_WITHIN_S = 10  # the bound for one rank's failure to end the job
LAUNCH_LIMIT_S = 60  # run_mpi's hang detector: a test needing longer has failed

# A user program: `mode` on rank 1 after `before` successful allreduce calls, then one more call.
VICTIM = """
import os, signal, sys, threading, time
import numpy as np
import mpigpu
from mpigpu.core._mpi import world

mode, before = sys.argv[1], int(sys.argv[2])
if "--install" in sys.argv:
    from mpigpu.job.failsafe import install_abort_handler
    install_abort_handler()
rank = world().Get_rank()
x = np.ones(8, np.float32)
for _ in range(before):
    mpigpu.allreduce(x, "sum")
if rank == 1:
    if mode == "raise":
        raise ValueError(f"boom on rank {rank}")
    if mode == "exit":
        sys.exit(3)
    if mode == "thread":
        worker = threading.Thread(target=lambda: 1 / 0)
        worker.start()
        worker.join()
        time.sleep(30)
    if mode == "sleep":
        time.sleep(30)
    if mode in ("SIGKILL", "SIGTERM"):
        os.kill(os.getpid(), getattr(signal, mode))
        time.sleep(30)
mpigpu.allreduce(x, "sum")
sys.stdout.write(f"rank {rank} done: {x[0]:g}\\n")  # one write: lines of ranks do not interleave
"""


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.py"
    path.write_text(VICTIM)
    return path


def timed(n: int, args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = run_mpi(n, args, timeout=LAUNCH_LIMIT_S, env=env)
    return result, time.monotonic() - start


def ended_with(result: subprocess.CompletedProcess, elapsed: float, *texts: str, limit: float = END_WITHIN_S) -> None:
    """The job ended in time, with a failure status, and stderr names the problem."""
    output = result.stdout + result.stderr
    assert elapsed < limit, f"took {elapsed:.1f} s (limit {limit} s)\n{output}"
    assert result.returncode != 0, output
    for text in texts:
        assert text in output, f"{text!r} missing from:\n{output}"


# -- python -m mpigpu.run ------------------------------------------------------------------------------
@pytest.mark.parametrize("before", [0, 3], ids=["before-first-call", "after-3-calls"])
def test_exception_on_one_rank_under_run_ends_job(victim: Path, before: int) -> None:
    result, elapsed = timed(3, ["-m", "mpigpu.run", str(victim), "raise", str(before)])
    ended_with(result, elapsed, "[mpigpu rank 1]", "ValueError: boom on rank 1", "victim.py", "aborting all ranks")
    assert result.returncode == 1
    assert "mpigpu/run.py" not in result.stderr, "the runner's own frames are left out of the traceback"


def test_exception_in_a_thread_under_run_ends_job(victim: Path) -> None:
    result, elapsed = timed(3, ["-m", "mpigpu.run", str(victim), "thread", "1"])
    ended_with(result, elapsed, "[mpigpu rank 1]", "ZeroDivisionError")


def test_sys_exit_on_one_rank_under_run_ends_job_with_its_status(victim: Path) -> None:
    result, elapsed = timed(3, ["-m", "mpigpu.run", str(victim), "exit", "1"])
    ended_with(result, elapsed, "[mpigpu rank 1] exited with status 3")
    assert result.returncode == 3


def test_run_normal_end_and_forms(victim: Path, tmp_path: Path) -> None:
    result, _ = timed(2, ["-m", "mpigpu.run", str(victim), "none", "1"])
    assert result.returncode == 0, result.stderr
    assert "rank 0 done: 4" in result.stdout and "rank 1 done: 4" in result.stdout  # 1 -> 2 -> 4 over 2 ranks

    code = (
        "import sys, numpy as np, mpigpu; x = np.ones(2); mpigpu.allreduce(x, 'sum'); "
        "sys.stdout.write(f'{sys.argv} {x[0]}\\n')"
    )
    result, _ = timed(2, ["-m", "mpigpu.run", "-c", code, "a", "b"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("['-c', 'a', 'b'] 2.0") == 2

    (tmp_path / "usermod.py").write_text(
        "import sys\n"
        "if __name__ == '__main__':\n"
        "    sys.stdout.write(f'module main {sys.argv[1:]}\\n')\n"
        "    sys.exit(0)\n"
    )
    result = run_mpi(2, ["-m", "mpigpu.run", "-m", "usermod", "x"], timeout=LAUNCH_LIMIT_S, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("module main ['x']") == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no program given"),
        (["--bogus", "x.py"], "unknown option '--bogus'"),
        (["does-not-exist.py"], "can't open file 'does-not-exist.py'"),
        (["--timeout", "soon", "x.py"], "--timeout 'soon'"),
        (["-m"], "-m needs an argument"),
    ],
)
def test_run_usage_errors(args: list[str], message: str) -> None:
    alone = subprocess.run(
        [sys.executable, "-m", "mpigpu.run", *args], capture_output=True, text=True, timeout=LAUNCH_LIMIT_S, cwd=ROOT
    )
    assert alone.returncode == 2 and message in alone.stderr and "usage:" in alone.stderr


def test_run_usage_error_on_one_rank_ends_job(victim: Path) -> None:
    result, elapsed = timed(2, _mpmd(["-m", "mpigpu.run", str(victim), "none", "1"], bad_args=["-m", "mpigpu.run"]))
    ended_with(result, elapsed, "[mpigpu rank 2]", "no program given")
    assert result.returncode == 2


def test_run_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mpigpu.run", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0
    for text in ("-m MODULE", "-c CODE", "--timeout SECONDS", "MPI_Abort", "exit status"):
        assert text in result.stdout


def test_run_timeout_option_sets_the_watchdog(victim: Path) -> None:
    result, elapsed = timed(3, ["-m", "mpigpu.run", "--timeout", "2", str(victim), "sleep", "1"])
    ended_with(result, elapsed, "CollectiveTimeout", "MPIGPU_TIMEOUT=2 s", limit=20)


# -- plain `python script.py` ------------------------------------------------------------------------
def test_plain_script_aborts_once_mpigpu_has_started(victim: Path) -> None:
    """mpigpu installs the main-thread handler on its first call: a later exception ends the job."""
    result, elapsed = timed(3, [str(victim), "raise", "1"])
    ended_with(result, elapsed, "[mpigpu rank 1]", "ValueError: boom on rank 1")


def test_plain_script_with_install_abort_handler_covers_failures_before_first_call(victim: Path) -> None:
    result, elapsed = timed(3, [str(victim), "raise", "0", "--install"])
    ended_with(result, elapsed, "ValueError: boom on rank 1")


@pytest.mark.parametrize("n", [2, 4])
def test_plain_script_aborts_on_an_exception_before_the_first_call(victim: Path, n: int) -> None:
    """The hook ``import mpigpu`` installs: no mpigpu call, no install_abort_handler, no mpigpu.run."""
    result, elapsed = timed(n, [str(victim), "raise", "0"])
    ended_with(result, elapsed, "[mpigpu rank 1]", "ValueError: boom on rank 1", "aborting all ranks")
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert output.count("Traceback (most recent call last)") == 1, f"the traceback once:\n{output}"
    assert "done" not in result.stdout


def test_plain_script_aborts_on_an_exception_in_a_thread_before_the_first_call(victim: Path) -> None:
    result, elapsed = timed(2, [str(victim), "thread", "0"])
    ended_with(result, elapsed, "[mpigpu rank 1]", "ZeroDivisionError", "aborting all ranks")
    assert (result.stdout + result.stderr).count("Traceback (most recent call last)") == 1


def test_a_hook_installed_before_import_runs_once_then_the_job_ends(tmp_path: Path) -> None:
    script = tmp_path / "hooked.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        def mine(kind, value, tb):
            sys.stderr.write(f"my hook: {kind.__name__}: {value}\\n")
        sys.excepthook = mine
        import numpy as np, mpigpu
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise KeyError("lost")
        mpigpu.allreduce(np.ones(4))
        """)
    )
    result, elapsed = timed(2, [str(script)])
    ended_with(result, elapsed, "my hook: KeyError: 'lost'", "KeyError (reported above)", "aborting all ranks")
    assert (result.stdout + result.stderr).count("my hook:") == 1


@pytest.mark.parametrize("before", [0, 1], ids=["before-first-call", "after-1-call"])
def test_plain_script_sys_exit_on_one_rank_ends_job_with_its_status(victim: Path, before: int) -> None:
    """Issue 30: rank 1's sys.exit(3) left it in MPI_Finalize and rank 0 in start-up until
    MPIGPU_TIMEOUT (exit status 124, the 3 lost). ``import mpigpu`` now ends the job with status 3."""
    result, elapsed = timed(2, [str(victim), "exit", str(before)], env={"MPIGPU_TIMEOUT": "20"})
    ended_with(result, elapsed, "[mpigpu rank 1] exited with status 3")
    assert result.returncode == 3, result.stderr
    assert "CollectiveTimeout" not in result.stderr and "done" not in result.stdout


EXITS = """
import sys, threading
import numpy as np, mpigpu
from mpigpu.core._mpi import world
rank = world().Get_rank()
if rank == 1:
    try:
        sys.exit(3)  # caught: the program goes on
    except SystemExit as exc:
        sys.stdout.write(f"caught {exc.code}\\n")
    worker = threading.Thread(target=sys.exit, args=(4,))  # ends that thread only
    worker.start()
    worker.join()
x = np.ones(2)
mpigpu.allreduce(x, "sum")
sys.stdout.write(f"rank {rank} done: {x[0]:g}\\n")
sys.exit(0)
"""


def test_a_caught_sys_exit_a_thread_s_and_sys_exit_0_end_nothing(tmp_path: Path) -> None:
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    result, elapsed = timed(2, [str(script)], env={"MPIGPU_TIMEOUT": "20"})
    assert result.returncode == 0 and elapsed < END_WITHIN_S, result.stdout + result.stderr
    assert "caught 3" in result.stdout and "rank 0 done: 2" in result.stdout and "rank 1 done: 2" in result.stdout
    assert "[mpigpu" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_sys_exit_outside_a_multi_rank_job_is_pythons(tmp_path: Path) -> None:
    """One process, no MPI: the status and the message as Python gives them, nothing from mpigpu."""
    for code, status, shown in [("sys.exit(3)", 3, ""), ("sys.exit('bye')", 1, "bye\n")]:
        done = subprocess.run(
            [sys.executable, "-c", f"import sys, mpigpu\n{code}"], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert (done.returncode, done.stderr) == (status, shown), (code, done.returncode, done.stderr)


@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_the_hook_at_import_can_be_turned_off(victim: Path, mode: str) -> None:
    """MPIGPU_ABORT_ON_EXCEPTION=0: rank 1 dies (or exits) alone; rank 0 waits until MPIGPU_TIMEOUT ends it."""
    result, elapsed = timed(2, [str(victim), mode, "0"], env={"MPIGPU_ABORT_ON_EXCEPTION": "0", "MPIGPU_TIMEOUT": "3"})
    ended_with(result, elapsed, *(["ValueError: boom on rank 1"] if mode == "raise" else []), limit=30)
    assert "aborting all ranks" not in result.stderr and "exited with status" not in result.stderr
    assert "CollectiveTimeout" in result.stderr, result.stderr


@pytest.mark.parametrize("launch", ["alone", "one rank"])
def test_the_hook_at_import_passes_exceptions_on_outside_a_multi_rank_job(tmp_path: Path, launch: str) -> None:
    """Without MPI (or with one rank) an uncaught exception is Python's usual traceback and exit 1;
    ``import mpigpu`` imports no mpi4py."""
    script = tmp_path / "alone.py"
    script.write_text(
        "import sys, threading, mpigpu\n"
        "from mpigpu.job import failsafe\n"
        "assert sys.excepthook is failsafe._excepthook and threading.excepthook is failsafe._thread_excepthook\n"
        "assert 'mpi4py' not in sys.modules, 'import mpigpu imported mpi4py'\n"
        "if sys.argv[1] == 'one rank':\n"
        "    from mpi4py import MPI\n"
        "raise ValueError('plain')\n"
    )
    if launch == "alone":
        result = subprocess.run(
            [sys.executable, str(script), launch], capture_output=True, text=True, timeout=LAUNCH_LIMIT_S, cwd=ROOT
        )
    else:
        result = run_mpi(1, [str(script), launch], timeout=LAUNCH_LIMIT_S)
    assert result.returncode == 1, result.stderr
    assert "ValueError: plain" in result.stderr and "aborting" not in result.stderr
    assert "[mpigpu" not in result.stderr


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_default_handler_can_be_turned_off(enabled: str) -> None:
    code = "import sys, mpigpu; mpigpu.select_device(); print('hooked', sys.excepthook is not sys.__excepthook__)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=LAUNCH_LIMIT_S,
        cwd=ROOT,
        env={**os.environ, "MPIGPU_ABORT_ON_EXCEPTION": enabled},
    )
    assert result.returncode == 0, result.stderr
    assert f"hooked {enabled == '1'}" in result.stdout


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_rank_killed_by_signal_ends_job(victim: Path, how: str) -> None:
    """The launcher's own job: MPICH's hydra ends the other ranks when one dies of a signal."""
    result, elapsed = timed(3, [str(victim), how, "1"])
    ended_with(result, elapsed)
    assert "done" not in result.stdout


def test_mismatch_ends_job_with_the_same_message_everywhere(tmp_path: Path) -> None:
    script = tmp_path / "mismatch.py"
    script.write_text(
        textwrap.dedent("""
        import numpy as np, mpigpu
        from mpigpu.core._mpi import world
        rank = world().Get_rank()
        mpigpu.allreduce(np.ones(10 + (rank == 2), np.float32))
        """)
    )
    result, elapsed = timed(3, [str(script)])
    ended_with(result, elapsed, "MismatchError", "count: 10 on ranks 0,1; 11 on rank 2")
    # every rank raises it (tests/test_bad_input_mpi.py checks the text is the same everywhere); the
    # first rank to abort may end the others before they print


# -- MPIGPU_TIMEOUT ----------------------------------------------------------------------------------
def test_timeout_aborts_a_collective_that_a_rank_never_joins(victim: Path) -> None:
    result, elapsed = timed(3, [str(victim), "sleep", "1"], env={"MPIGPU_TIMEOUT": "2"})
    ended_with(result, elapsed, "CollectiveTimeout: allreduce of 8 float32", "MPIGPU_TIMEOUT=2 s", limit=20)
    assert result.returncode == 124
    assert "victim.py" in result.stderr, "the message shows where the rank waited"


def test_timeout_covers_start_up(victim: Path) -> None:
    result, elapsed = timed(3, [str(victim), "sleep", "0"], env={"MPIGPU_TIMEOUT": "2"})
    ended_with(result, elapsed, "CollectiveTimeout: mpigpu start-up", "MPIGPU_TIMEOUT=2 s", limit=20)


# The watchdog times out a watched wait that then ends after all, and the program ends normally at once:
# the abort (printed, then MPI_Abort after a pause for the launcher to forward the message) is under way.
LATE_END = """
import sys, time
from mpi4py import MPI
from mpigpu.job.failsafe import Watchdog
MPI.COMM_WORLD.Barrier()
with Watchdog(timeout=0.1).watch("a watched wait"):
    time.sleep(0.3)  # the watchdog fires at 0.1-0.2 s; its MPI_Abort follows 0.2 s later
"""


@pytest.mark.parametrize("n", [1, 2])
def test_a_timeout_that_printed_aborting_ends_the_job_non_zero(tmp_path: Path, n: int) -> None:
    """Issue 39: MPIGPU_TIMEOUT=0.001 printed "Aborting the job" and the job exited 0: the main thread's
    normal end won the race against the watchdog's MPI_Abort. The abort under way now ends the job."""
    script = tmp_path / "late_end.py"
    script.write_text(LATE_END)
    for _ in range(2):
        result, elapsed = timed(n, [str(script)])
        ended_with(result, elapsed, "CollectiveTimeout: a watched wait did not complete", "Aborting the job")
        assert result.returncode == 124, result.stdout + result.stderr


@pytest.mark.parametrize("n", [2, 4])
def test_mpigpu_timeout_far_below_a_calls_time_never_exits_0_after_aborting(n: int) -> None:
    """The issue's own command: whether or not the watchdog catches a call at 0.001 s, a job that says it
    aborts ends with status 124, and one that does not passes."""
    result, elapsed = timed(n, ["-m", "mpigpu.average", "--size", "1K"], env={"MPIGPU_TIMEOUT": "0.001"})
    output = result.stdout + result.stderr
    assert elapsed < LAUNCH_LIMIT_S
    if "Aborting the job" in output:
        assert result.returncode == 124, output
    else:
        assert result.returncode == 0 and "# PASS" in result.stdout, output


# -- a rank gone between calls -------------------------------------------------------------------------
GONE = """
import os, sys
import numpy as np
import mpigpu
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
x = np.ones(8, np.float32)
mpigpu.allreduce(x, "sum")
if rank == 1:
    os._exit(0)  # no exception, no exit hook, no MPI_Finalize: gone
mpigpu.allreduce(x, "sum")
print(f"rank {rank} done", flush=True)
"""


def _hydra() -> bool:
    from conftest import mpiexec

    done = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=30, check=False)
    return "HYDRA" in done.stdout


def test_a_rank_gone_between_calls_is_reported_by_its_node_mates(tmp_path: Path) -> None:
    """Issue 39. Where the launcher lets the others run on (hydra's -disable-auto-cleanup here; by default
    hydra kills them at once, see docs/troubleshooting.md), the rank waiting for the one gone says so within
    seconds, rather than waiting for MPIGPU_TIMEOUT (30 s here) with a message that does not say why."""
    if not _hydra():
        pytest.skip("needs MPICH's hydra mpiexec (-disable-auto-cleanup): the mpich wheel's launcher")
    from conftest import mpiexec

    script = tmp_path / "gone.py"
    script.write_text(GONE)
    env = outside_job_env()
    env.update({"MPIGPU_TIMEOUT": "30", "PYTHONUNBUFFERED": "1"})
    command = [mpiexec(), "-disable-auto-cleanup", "-n", "2", sys.executable, str(script)]
    start = time.monotonic()
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=LAUNCH_LIMIT_S, env=env, cwd=ROOT, check=False
    )
    ended_with(result, time.monotonic() - start, "RankGone: rank 1 (pid", "ended while this rank waits in allreduce")
    assert result.returncode == 1 and "rank 0 done" not in result.stdout, result.stdout + result.stderr


# -- the stall report ----------------------------------------------------------------------------------
# Rank 1 skips the second of three calls (or makes a fourth), then stays alive: the others wait.
STALLER = """
import sys, time
import numpy as np
import mpigpu
from mpi4py import MPI
mode, rank = sys.argv[1], MPI.COMM_WORLD.Get_rank()
x = np.ones(8, np.float32)
for i in range(4 if mode == "extra" and rank == 1 else 3):
    if not (mode == "skip" and rank == 1 and i == 1):
        mpigpu.allreduce(x, "sum")
if rank == 1:
    time.sleep(30)
"""
FAST_STALL = {"MPIGPU_STALL": "1", "MPIGPU_TIMEOUT": "4"}


def _stalled_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "stalled:" in line]


@pytest.mark.parametrize("n", [2, 4])
def test_a_skipped_call_is_reported_by_every_waiting_rank_then_the_job_ends(tmp_path: Path, n: int) -> None:
    (tmp_path / "staller.py").write_text(STALLER)
    result, elapsed = timed(n, [str(tmp_path / "staller.py"), "skip"], env=FAST_STALL)
    ended_with(result, elapsed, "CollectiveTimeout", limit=30)
    assert result.returncode == 124
    lines = _stalled_lines(result.stderr)
    waiting = [r for r in range(n) if r != 1]
    assert sorted(line.split("]")[0] for line in lines) == [f"[mpigpu rank {r}" for r in waiting], result.stderr
    checks = ", ".join("2" if r == 1 else "3" for r in range(n))
    for line in lines:
        assert "in allreduce of 8 float32" in line and "mpigpu call 3 on its communicator" in line, line
        assert f"rank 1 has not reached argument check 3, where this rank is (checks by rank: {checks})" in line


def test_one_call_more_on_one_rank_is_reported(tmp_path: Path) -> None:
    (tmp_path / "staller.py").write_text(STALLER)
    result, elapsed = timed(2, [str(tmp_path / "staller.py"), "extra"], env=FAST_STALL)
    ended_with(result, elapsed, "CollectiveTimeout", limit=30)
    lines = [line for line in _stalled_lines(result.stderr) if line.startswith("[mpigpu rank 1]")]
    assert len(lines) == 1, result.stderr
    assert "mpigpu call 4 on its communicator of 2 ranks; rank 0 has not reached argument check 4" in lines[0]


def test_without_the_check_board_the_nodes_call_counts_name_the_late_rank(tmp_path: Path) -> None:
    (tmp_path / "staller.py").write_text(STALLER)
    result, elapsed = timed(2, [str(tmp_path / "staller.py"), "skip"], env={**FAST_STALL, "MPIGPU_CHECK": "0"})
    ended_with(result, elapsed, "CollectiveTimeout", limit=30)
    lines = _stalled_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("[mpigpu rank 0]"), result.stderr
    assert "mpigpu call 3 on its communicator of 2 ranks; on this rank's node 0 (host " in lines[0], lines[0]
    assert "), rank 1 has not reached it. Every rank" in lines[0], lines[0]


def test_the_stall_report_can_be_turned_off(tmp_path: Path) -> None:
    (tmp_path / "staller.py").write_text(STALLER)
    result, elapsed = timed(2, [str(tmp_path / "staller.py"), "skip"], env={**FAST_STALL, "MPIGPU_STALL": "0"})
    ended_with(result, elapsed, "CollectiveTimeout", limit=30)
    assert not _stalled_lines(result.stderr), result.stderr


# -- mpigpu's commands, one rank given bad settings or options (MPMD launch) --------------------------
def _mpmd(good: list[str], bad_env: dict[str, str] | None = None, bad_args: list[str] | None = None) -> list[str]:
    """Arguments for run_mpi(3, ...): ranks 0-2 run ``good``; a fourth rank runs the bad variant."""
    env = [f"{k}={v}" for k, v in (bad_env or {}).items()]
    return [*good, ":", "-n", "1", "env", *env, sys.executable, *(bad_args or good)]


@pytest.mark.parametrize(
    ("variable", "value"), [("MPIGPU_TIMEOUT", "bad"), ("MPIGPU_CHECK", "maybe"), ("MPIGPU_NODE_SIZE", "0")]
)
def test_average_with_bad_setting_on_one_rank_ends_job(variable: str, value: str) -> None:
    args = _mpmd(["-m", "mpigpu.average", "--size", "1K", "--iters", "2"], bad_env={variable: value})
    result, elapsed = timed(3, args)
    ended_with(result, elapsed, f"{variable}={value!r} is not valid", "rank 3 failed")


# Every rank prints the ConfigError it raised at start-up, on one line.
REPORTS_CONFIG_ERROR = """
import os
import numpy as np, mpigpu
from mpigpu.core._mpi import world
from mpigpu.core.errors import ConfigError
try:
    mpigpu.allreduce(np.ones(4))
except ConfigError as exc:
    os.write(1, f"rank {world().Get_rank()}: ConfigError: {' '.join(str(exc).split())}\\n".encode())
"""
HUGE = str(2**63)  # no int64 holds it


def _config_errors(result: subprocess.CompletedProcess, n: int) -> list[str]:
    """Each rank's ConfigError line, in rank order (the job's output when there are not ``n``)."""
    lines = sorted(line for line in result.stdout.splitlines() if ": ConfigError: " in line)
    assert [line.split(":")[0] for line in lines] == [f"rank {r}" for r in range(n)], result.stdout + result.stderr
    return [line.split(": ConfigError: ", 1)[1] for line in lines]


@pytest.mark.parametrize("variable", sorted(INT_RANGES))
def test_a_huge_integer_setting_on_one_rank_fails_every_rank_alike(tmp_path: Path, variable: str) -> None:
    """Issue 30: rank 1 raised a raw OverflowError before the start-up exchange and the others waited
    in it until MPIGPU_TIMEOUT. Now every rank raises the same ConfigError naming the variable, at once."""
    script = tmp_path / "config_error.py"
    script.write_text(REPORTS_CONFIG_ERROR)
    args = [str(script), ":", "-n", "1", "env", f"{variable}={HUGE}", sys.executable, str(script)]
    result, elapsed = timed(1, args, env={"MPIGPU_TIMEOUT": "20"})  # bounds the old stall
    assert elapsed < END_WITHIN_S and result.returncode == 0, f"{elapsed:.1f} s\n{result.stdout}{result.stderr}"
    errors = _config_errors(result, 2)
    assert errors[0] == errors[1], errors
    assert "rank 1 failed" in errors[0] and f"{variable}='{HUGE}' is not valid" in errors[0], errors[0]
    low, high = INT_RANGES[variable]
    assert f"from {low} to {high}" in errors[0], errors[0]


@pytest.mark.parametrize("variable", ["MPIGPU_NODE_SIZE", "MPIGPU_HOST_POOL_MB"])
def test_a_huge_integer_setting_on_every_rank_is_the_same_config_error(tmp_path: Path, variable: str) -> None:
    """Set alike on every rank it was a raw OverflowError; now the ConfigError itself, everywhere."""
    script = tmp_path / "config_error.py"
    script.write_text(REPORTS_CONFIG_ERROR)
    result, elapsed = timed(2, [str(script)], env={variable: HUGE, "MPIGPU_TIMEOUT": "20"})
    assert elapsed < END_WITHIN_S and result.returncode == 0, f"{elapsed:.1f} s\n{result.stdout}{result.stderr}"
    errors = _config_errors(result, 2)
    assert errors[0] == errors[1] and errors[0].startswith(f"{variable}='{HUGE}' is not valid"), errors


def test_average_with_bad_option_on_one_rank_ends_job() -> None:
    good = ["-m", "mpigpu.average", "--size", "1K", "--iters", "2"]
    result, elapsed = timed(3, _mpmd(good, bad_args=["-m", "mpigpu.average", "--size", "lots"]))
    ended_with(result, elapsed, "[mpigpu rank 3]", "invalid size 'lots'")
    assert result.returncode == 2


def test_average_with_bad_option_everywhere_exits_2() -> None:
    result, elapsed = timed(2, ["-m", "mpigpu.average", "--dtype", "complex64"])
    ended_with(result, elapsed, "unsupported dtype 'complex64'")
    assert result.returncode == 2
    assert result.stderr.count("unsupported dtype") == 1, "reported once (by rank 0), not once per rank"


def test_bench_with_bad_setting_on_one_rank_ends_job() -> None:
    pytest.importorskip("mpigpu.bench", reason="mpigpu.bench is not in this tree yet")
    args = _mpmd(["-m", "mpigpu.bench", "--max-bytes", "64"], bad_env={"MPIGPU_TIMEOUT": "bad"})
    result, elapsed = timed(3, args)
    ended_with(result, elapsed, "MPIGPU_TIMEOUT='bad' is not valid")


def test_unknown_variable_is_reported() -> None:
    result, _ = timed(2, ["-m", "mpigpu.average", "--size", "16", "--iters", "1"], env={"MPIGPU_TIMOUT": "5"})
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("ignoring unknown variable(s) MPIGPU_TIMOUT") == 1


# -- settings, unit level ------------------------------------------------------------------------------
BAD_VALUES = {
    "MPIGPU_CUDA_AWARE": ["2", "yes please"],
    "MPIGPU_NODE_SIZE": ["0", "-1", "two"],
    "MPIGPU_TIMEOUT": ["-1", "nan", "inf", "10s", "2e10", "1000001"],  # 2e10 s overflowed the ipc kernel's ns counter
    "MPIGPU_STALL": ["-1", "soon"],
    "MPIGPU_CHECK": ["maybe"],
    "MPIGPU_ABORT_ON_EXCEPTION": ["sometimes"],
    "MPIGPU_ALLOW_SHARED_GPU": ["2"],
    "MPIGPU_HOST_POOL_MB": ["0", "-5", "lots"],
    "MPIGPU_HOST_CHUNK": ["0", "4X"],
    "MPIGPU_LOG": ["verbose"],
}


@pytest.mark.parametrize(("variable", "value"), [(k, v) for k, vs in BAD_VALUES.items() for v in vs])
def test_bad_setting_names_variable_value_and_what_is_accepted(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        Settings.from_env()
    message = str(info.value)
    assert f"{variable}={value!r}" in message and "not valid" in message
    assert any(word in message for word in ("use", "seconds", "N:", "MiB", "bytes")), message


def test_the_largest_timeout_fits_the_ipc_kernels_nanosecond_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from mpigpu.core.config import MAX_TIMEOUT_S

    monkeypatch.setenv("MPIGPU_TIMEOUT", f"{MAX_TIMEOUT_S:g}")
    timeout = Settings.from_env().timeout
    assert timeout == MAX_TIMEOUT_S
    assert int(np.uint64(int(timeout * 1e9))) == int(timeout * 1e9)  # what backends/ipc.py passes the kernel


def test_every_validated_variable_is_documented() -> None:
    assert set(BAD_VALUES) <= set(ENV_VARS)
