"""Mis-launches on a real GPU across MPI's own nodes (issue 45, goal 6): two nodes of MPICH's fork launcher on
one GPU machine, run serially (each test starts its own launcher). One node that sees the GPU and one that
does not, and two ranks on one node sharing one GPU: every rank ends with the same DeviceError naming the
node, within seconds, never a hang. tests/nodes/test_mislaunch_nodes.py tests the same decisions on CPU."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import ROOT, nodes_launcher, outside_job_env

from mpigpu.cli import launcher_rank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it starts mpiexec")]

CALL = "import numpy as np, mpigpu; mpigpu.allreduce(np.ones(4, np.float32)); print('ran')"


def _launch(hosts: str, parts: list[dict[str, str]], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    """One rank per part, each with its own variables (MPMD), spread over the MPI nodes ``hosts``."""
    command = nodes_launcher(hosts)
    for i, part in enumerate(parts):
        command += [":"] if i else []
        command += ["-n", "1", *[a for k, v in part.items() for a in ("-env", k, v)], sys.executable, "-c", CALL]
    clean = outside_job_env()
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**clean, **env},
                          check=False)  # fmt: skip
    return done, time.monotonic() - start


def test_a_node_without_the_gpu_beside_one_with_it() -> None:
    done, elapsed = _launch("nodeA:1,nodeB:1", [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": ""}], {})
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "ran" not in done.stdout, output
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "DeviceError: some ranks see GPUs and others none: no GPU for rank 1 on node 1 (host " in output, output
    assert "while node 0 (host " in output and "sees 1 GPU(s)" in output, output


def test_two_ranks_of_one_node_on_one_gpu_beside_a_node_with_its_own() -> None:
    env = {"MPIGPU_ALLOW_SHARED_GPU": "0"}
    parts = [{"CUDA_VISIBLE_DEVICES": "0"}] * 3
    done, elapsed = _launch("nodeA:2,nodeB:1", parts, env)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "ran" not in done.stdout, output
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "DeviceError: more ranks than GPUs: 2 ranks share 1 GPU(s) on node 0 (host " in output, output
