"""Under ``python -m mpigpu.run``, SIGINT to one rank ends the whole job, with a non-zero status,
also when that rank is blocked in a collective that another rank has not joined (issue 12,
section 4). Python alone keeps the KeyboardInterrupt pending until the collective returns, that is,
until the other rank arrives: here, not for 60 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, mpiexec, outside_job_env

END_WITHIN_S = 10
START_LIMIT_S = 60

# Rank 1 enters an allreduce at once; rank 0 joins it only after 60 s. `python` (the Python loop
# variant) keeps rank 1 in Python code instead, where SIGINT raises KeyboardInterrupt as usual.
PROGRAM = """
import os, sys, time
import numpy as np
import mpigpu
from mpigpu.core._mpi import world

pid_file, where = sys.argv[1], sys.argv[2]
rank = world().Get_rank()
x = np.ones(8)
mpigpu.allreduce(x, "sum")  # start-up, on both ranks
if rank == 1:
    with open(pid_file + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_file + ".part", pid_file)
    if where == "python":
        while True:
            time.sleep(0.01)
else:
    time.sleep(60)
mpigpu.allreduce(x, "sum")
print(f"rank {rank} finished", flush=True)
"""


def _clean_env() -> dict[str, str]:
    env = outside_job_env()
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("where", ["collective", "python"])
def test_sigint_to_one_rank_ends_the_job(tmp_path: Path, where: str) -> None:
    script = tmp_path / "program.py"  # tmp_path is private to this user (0700)
    script.write_text(PROGRAM)
    pid_file = tmp_path / "rank1.pid"
    command = [mpiexec(), "-n", "2", sys.executable, "-m", "mpigpu.run", str(script), str(pid_file), where]
    job = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
        cwd=ROOT,
        start_new_session=True,  # its own process group, so the cleanup below reaches only this job
    )
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while not pid_file.exists():
            assert job.poll() is None, f"the job ended before rank 1 was ready: {job.communicate()}"
            assert time.monotonic() < deadline, "rank 1 did not start within the limit"
            time.sleep(0.05)
        time.sleep(0.5)  # rank 1 is now inside the allreduce (or its loop)
        sent = time.monotonic()
        os.kill(int(pid_file.read_text()), signal.SIGINT)
        try:
            out, err = job.communicate(timeout=END_WITHIN_S + 20)
        except subprocess.TimeoutExpired:
            pytest.fail("the job still ran 30 s after SIGINT to rank 1")
        elapsed = time.monotonic() - sent
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode != 0, (out, err)
    assert elapsed < END_WITHIN_S, f"the job ended {elapsed:.1f} s after SIGINT\n{err}"
    assert "finished" not in out
    assert "KeyboardInterrupt" in err, err
