"""Every call and layer on MPI's own nodes (issue 45, goal 3), in jobs these tests start (serial): nodes made
by MPICH's fork launcher with named hosts (conftest.nodes_launcher), where MPI_COMM_TYPE_SHARED splits by
host and traffic between the nodes goes through MPICH's network module.

- ``test_layers_nodes_mpi.py`` as one pytest session at 2x2 (by node and round-robin) and 2+1: the five
  collectives on cpu, host and auto, persistent requests, async calls, the averagers and the Horovod layer's
  node numbers.
- Horovod's own ``test_torch.py`` at 2x2 on CPU, where HOROVOD_CHECKOUT names a Horovod checkout
  (scripts/hvd-suite.sh prepares the folder; nothing of Horovod is in this repository).

Several host devices per process across nodes: tests/multi/test_per_process_jobs.py; the timeline's nodes:
tests/timeline/test_timeline_jobs.py; faults across nodes: test_faults_nodes.py."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, run_mpi

from mpigpu.cli import launcher_rank

pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

HOSTS = "nodeA:2,nodeB:2"
LAYERS = Path(__file__).with_name("test_layers_nodes_mpi.py")
# Horovod's tests that fail on one node too, before any Horovod call: PyTorch 2.13's Muon optimizer
# refuses 1-D parameters (docs/horovod.md)
MUON = {"test_broadcast_state", "test_broadcast_state_options", "test_force_allreduce"}


def _summary(output: str) -> dict[str, int]:
    """pytest's closing counts: {"passed": 26, "failed": 1, ...}."""
    last = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    assert last, output
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", last[-1])}


@pytest.mark.parametrize(
    ("hosts", "n"), [(HOSTS, 4), ("nodeA:1,nodeB:1", 4), ("nodeA:2,nodeB:1", 3)], ids=["2x2", "2x2-round-robin", "2+1"]
)
def test_every_call_and_layer_across_nodes(hosts: str, n: int) -> None:
    """2x2 by node (ranks 0,1 on node 0) and round-robin (ranks 0,2 on node 0: a node's ranks are not
    neighbours), and 2+1 (nodes of unequal size)."""
    pytest.importorskip("torch", reason="the averager and Horovod tests need torch (the CI test script installs it)")
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi", str(LAYERS)]
    done = run_mpi(n, args, timeout=300, env={"NODES_EXPECTED": "2"}, hosts=hosts)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    counts = _summary(done.stdout)
    assert counts.get("passed", 0) >= 26 and set(counts) == {"passed"}, counts  # nothing skipped, nothing failed


def test_horovods_own_torch_tests_at_2x2(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="Horovod's PyTorch tests need torch (the CI test script installs it)")
    checkout = os.environ.get("HOROVOD_CHECKOUT")
    if not checkout:
        pytest.skip("HOROVOD_CHECKOUT is not set: Horovod's test_torch.py is not in this repository")
    suite = tmp_path / "suite"
    made = subprocess.run(["bash", str(ROOT / "scripts" / "hvd-suite.sh"), checkout, str(suite)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert made.returncode == 0, made.stderr
    args = ["-m", "pytest", "-c", "pytest.ini", "--rootdir", ".", "-q", "-p", "no:cacheprovider", "-rf",
            "test/parallel/test_torch.py"]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(suite), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MPIGPU_TIMEOUT": "120"}  # fmt: skip
    done = run_mpi(4, args, timeout=1200, env=env, cwd=suite, hosts=HOSTS)  # 2.5 min here at load 18, once
    failed = set(re.findall(r"^FAILED \S+::(\w+)", done.stdout, re.M))
    assert failed <= MUON, f"failed beyond the Muon artefact: {sorted(failed - MUON)}\n{done.stdout[-8000:]}"
    counts = _summary(done.stdout)
    assert counts.get("passed", 0) >= 100, counts
