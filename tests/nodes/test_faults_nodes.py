"""Faults across MPI's own nodes (issue 45, goal 5): jobs at 2x2 that these tests start (serial), the nodes
made by MPICH's fork launcher with named hosts (conftest.nodes_launcher).

- Every rank of one node killed (SIGKILL): the job ends within 10 s of the kill, with a failure status.
- A rank that stalls on the other node: the stall report of its node's waiting rank names it and the node.
- Ranks of one node passing other arguments, or one of them an argument it rejects: every rank raises for
  that call, and the next call pairs (its sum is right on every rank).

What a killed job leaves in /dev/shm is MPICH's own: one ``mpich_shm_<job>_<node>`` file per node, which
MPI_Finalize would have removed (conftest's fixture removes it after each test)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from conftest import mpich_segments, run_mpi

from mpigpu.cli import launcher_rank

pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

JOB = str(Path(__file__).with_name("faults_job.py"))
HOSTS = "nodeA:2,nodeB:2"
END_WITHIN_S = 10  # the bound
LIMIT_S = 90  # run_mpi's hang detector: far above any start-up on a loaded machine


def test_killing_every_rank_of_one_node_ends_the_job(tmp_path: Path) -> None:
    before = set(mpich_segments())
    done = run_mpi(4, [JOB, "kill", str(tmp_path)], timeout=LIMIT_S, hosts=HOSTS)
    ended = time.time()
    output = done.stdout + done.stderr
    killed = {p.name: float(p.read_text()) for p in tmp_path.glob("killed-*")}
    assert sorted(killed) == ["killed-2", "killed-3"], output  # both ranks of node 1, after three good calls
    assert ended - max(killed.values()) < END_WITHIN_S, f"ended {ended - max(killed.values()):.1f} s after the kill"
    assert done.returncode != 0, output
    assert "done:" not in done.stdout, "no rank finished its fourth call"
    left = sorted(p.name for p in set(mpich_segments()) - before)
    assert all(re.fullmatch(r"mpich_shm_\w+_[01]", name) for name in left), left  # MPICH's own, per node


def test_a_rank_stalling_on_another_node_is_named_with_its_node() -> None:
    env = {"MPIGPU_STALL": "1", "MPIGPU_TIMEOUT": "8"}
    done = run_mpi(4, [JOB, "stall"], timeout=LIMIT_S, env=env, hosts=HOSTS)
    assert done.returncode == 124, done.stdout + done.stderr  # MPIGPU_TIMEOUT's status
    lines = {int(m[1]): m[0] for m in re.finditer(r"^\[mpigpu rank (\d)\] stalled: .*$", done.stderr, re.M)}
    assert sorted(lines) == [0, 1, 2], done.stderr  # every waiting rank reports; rank 3 sleeps outside mpigpu
    assert "mpigpu call 4 on its communicator of 4 ranks; on this rank's node 1 (host " in lines[2]
    assert "), rank 3 has not reached it; ranks on other nodes are named by their nodes' reports" in lines[2]
    for rank in (0, 1):
        assert "on this rank's node 0 (host " in lines[rank], lines[rank]
        assert "every rank of this node (ranks 0,1) has reached it" in lines[rank], lines[rank]
    assert "CollectiveTimeout" in done.stderr


def test_a_mismatch_between_nodes_raises_everywhere_and_the_next_call_pairs() -> None:
    done = run_mpi(4, [JOB, "mismatch"], timeout=LIMIT_S, hosts=HOSTS)
    assert done.returncode == 0, done.stdout + done.stderr
    said = dict(re.findall(r"^rank (\d call [\w-]+): (.*)$", done.stdout, re.M))
    counts = "count: 8 on ranks 0,1; 9 on ranks 2,3"
    for rank in range(4):
        assert said[f"{rank} call count"].startswith("MismatchError: allreduce: ranks passed different"), said
        assert counts in said[f"{rank} call count"], said
        assert said[f"{rank} call after-count"] == "10", said  # 1 + 2 + 3 + 4: the next call paired
        assert said[f"{rank} call after-op"] == "14", said  # 2 + 3 + 4 + 5
    assert said["3 call op"] == "InvalidArgument: unknown op 'bogus': use one of sum, avg, min, max, prod"
    for rank in range(3):
        assert said[f"{rank} call op"].startswith("MismatchError: allreduce did not run: rank 3 rejected the"), said
        assert "unknown op 'bogus'" in said[f"{rank} call op"], said
