"""mpigpu.job.leave: what a rank ending with an error every rank raised can see of the others, and
the closing of its output pipes before any rank exits (the order itself is checked by
test_one_account.py under mpiexec: status 1, no launcher banner)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from mpigpu.job import leave

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")

_SLEEPER = "import sys, time; sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(30)"
_NAMED_LEFT = (
    "import sys, time; open('/proc/self/comm', 'wb').write(b'mpigpu-left'); "
    "sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(30)"
)


def _started(code: str) -> tuple[subprocess.Popen[str], leave.Process]:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "up\n"
    return child, (child.pid, leave._start_time(child.pid))


def test_a_running_process_is_alive_and_has_not_left() -> None:
    child, process = _started(_SLEEPER)
    try:
        assert process[1] != ""
        assert leave._alive(process)
        assert not leave._has_left(process)
    finally:
        child.kill()
        child.wait()


def test_a_process_that_named_itself_left_has_left_while_it_runs() -> None:
    child, process = _started(_NAMED_LEFT)
    try:
        assert leave._alive(process)
        assert leave._has_left(process)
    finally:
        child.kill()
        child.wait()


def test_an_ended_process_zombie_or_reaped_has_left() -> None:
    child, process = _started(_SLEEPER)
    child.kill()
    deadline = 200
    while leave._alive(process) and deadline:  # a zombie until reaped: not alive either
        time.sleep(0.01)
        deadline -= 1
    assert not leave._alive(process) and leave._has_left(process)
    child.wait()
    assert not leave._alive(process) and leave._has_left(process)


def test_a_reused_pid_is_not_the_process() -> None:
    child, (pid, _) = _started(_SLEEPER)
    try:
        assert not leave._alive((pid, "1"))  # the same pid, another start time
    finally:
        child.kill()
        child.wait()


def test_closing_output_ends_the_pipes_the_launcher_reads_while_the_process_lives() -> None:
    """Every copy of the stdout and stderr pipes is pointed at /dev/null: the reader sees EOF on both
    while the process still runs, and what was printed before arrives whole."""
    code = textwrap.dedent(
        """
        import os, sys, time
        from mpigpu.job import leave
        copy_out, copy_err = os.dup(1), os.dup(2)  # as MPICH keeps its own
        print("before", flush=True)
        sys.stderr.write("err before\\n"); sys.stderr.flush()
        leave._close_output()
        os.write(copy_out, b"after\\n")  # goes to /dev/null, and does not fail
        time.sleep(30)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stderr is not None
        out, err = child.stdout.read(), child.stderr.read()  # each returns at EOF, long before the sleep ends
        assert child.poll() is None, "the pipes closed only because the process ended"
        assert out == b"before\n"
        assert err == b"err before\n"
    finally:
        child.kill()
        child.wait()


def test_rank_0_waits_for_a_peer_still_finalising_and_not_for_one_that_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leave, "WAIT_S", 2.0)
    running, running_process = _started(_SLEEPER)
    left, left_process = _started(_NAMED_LEFT)
    try:
        start = time.monotonic()
        leave._wait(leave._has_left, [left_process])
        assert time.monotonic() - start < 2.0  # not held to WAIT_S
        start = time.monotonic()
        leave._wait(leave._has_left, [left_process, running_process])
        assert time.monotonic() - start >= 2.0  # held to WAIT_S by the one still running
    finally:
        for child in (running, left):
            child.kill()
            child.wait()
