"""Plain ``python -m mpigpu.bench`` on a machine without a GPU: the quick default sweep (8 B to 64 MiB
in steps of 4, not 1 GiB in steps of 2), a progress line per measurement on stderr, and Ctrl-C
printing the results measured so far (exit status 130) instead of an abort from every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, gpu_available, mpiexec


@pytest.mark.skipif(gpu_available(), reason="with GPUs the default sweep is the full one")
def test_ctrl_c_prints_the_results_so_far_of_the_quick_default() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_COMM_WORLD_"))}
    env["PYTHONUNBUFFERED"] = "1"
    # its own session, as a terminal's job: Ctrl-C reaches the launcher and the ranks alike
    job = subprocess.Popen(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpigpu.bench"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert job.stderr is not None
        progress = []
        deadline = time.monotonic() + 120
        while len(progress) < 3 and time.monotonic() < deadline:  # a few measurements done
            line = job.stderr.readline()
            if not line:
                break
            if line.startswith("[bench] "):
                progress.append(line)
        assert len(progress) == 3, "no progress lines on stderr"
        os.killpg(job.pid, signal.SIGINT)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 130, out + err
    assert "# sizes 8 B .. 64 MiB x4 (13 sizes)" in out, out
    assert "# INTERRUPTED (Ctrl-C) after " in out and "# side by side [host arrays" in out, out
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
