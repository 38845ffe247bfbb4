"""A mis-launched job fails at start-up on every rank, together, with one message that names the nodes (issue
45, goal 6): more ranks than GPUs on a node, some nodes (or ranks) with GPUs and others without, a rank that
cannot take its GPUs. The decision (mpigpu.job.device.launch_problem) is tested on rows of what each rank
found; the whole start-up in jobs at 2x2 on MPI's own nodes whose ranks are made to see N GPUs each (this
machine has none: faults_job.py's ``gpus`` mode replaces the two looks at the hardware)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_mpi

from mpigpu.cli import launcher_rank
from mpigpu.job.device import Found, launch_problem

JOB = str(Path(__file__).with_name("faults_job.py"))


def _rows(*nodes: list[tuple[int, str]]) -> list[Found]:
    """Rows of ranks in order, node by node: each rank as (GPUs it sees, its GPU's bus id)."""
    return [Found(n, f"gpu{n:02d}", seen, bus, "") for n, ranks in enumerate(nodes) for seen, bus in ranks]


def test_one_rank_per_gpu_or_no_gpu_anywhere_is_no_problem() -> None:
    assert launch_problem(_rows([(2, "a"), (2, "b")], [(2, "a"), (2, "b")]), False) == ("", "")
    assert launch_problem(_rows([(1, "a")], [(1, "a")]), False) == ("", "")  # the same bus id on two nodes
    assert launch_problem(_rows([(0, ""), (0, "")], [(0, "")]), False) == ("", "")


def test_more_ranks_than_gpus_on_one_node_names_it() -> None:
    rows = _rows([(2, "a"), (2, "b")], [(1, "a"), (1, "a"), (1, "a")])
    error, warning = launch_problem(rows, False)
    assert error.startswith("more ranks than GPUs: 3 ranks share 1 GPU(s) on node 1 (host gpu01: ranks 2,3,4).")
    assert "MPIGPU_ALLOW_SHARED_GPU=1" in error and "-ppn" in error and "ppr:" in error and not warning
    error, warning = launch_problem(rows, True)
    assert (
        not error
        and warning == "3 ranks share 1 GPU(s) on node 1 (host gpu01: ranks 2,3,4) (MPIGPU_ALLOW_SHARED_GPU=1)"
    )


def test_a_node_without_gpus_beside_one_with_them() -> None:
    error, _ = launch_problem(_rows([(4, "a"), (4, "b")], [(0, ""), (0, "")]), True)  # sharing allowed: no excuse
    assert error.startswith(
        "some ranks see GPUs and others none: no GPU for ranks 2,3 on node 1 (host gpu01: ranks 2,3), while node 0 "
        "(host gpu00: ranks 0,1) sees 4 GPU(s)."
    ), error
    assert "CUDA_VISIBLE_DEVICES" in error


def test_one_rank_without_a_gpu_on_a_node_with_them() -> None:
    error, _ = launch_problem(_rows([(2, "a"), (2, "b")], [(2, "a"), (0, "")]), False)
    assert "no GPU for rank 3 on node 1 (host gpu01: ranks 2,3), while node 0 (host gpu00: ranks 0,1) sees 2, " in error
    assert "node 1 (host gpu01: ranks 2,3) sees 2 GPU(s)" in error


def test_a_rank_that_could_not_take_its_gpus_comes_first() -> None:
    rows = _rows([(2, "a"), (2, "a")], [(2, "a"), (0, "")])
    rows[1] = rows[1]._replace(bus_id="", error="DeviceError: MPIGPU_DEVICES_PER_RANK=3 ... needs 6 GPUs")
    error, _ = launch_problem(rows, False)
    assert error == (
        "mpigpu start-up did not run: a rank could not take its GPUs.\n"
        "  rank 1 on node 0 (host gpu00: ranks 0,1): DeviceError: MPIGPU_DEVICES_PER_RANK=3 ... needs 6 GPUs"
    )


@pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")
@pytest.mark.parametrize(
    ("gpus", "says"),
    [
        ("2,2,0,0", "some ranks see GPUs and others none: no GPU for ranks 2,3 on node 1 (host "),
        ("1,1,2,2", "more ranks than GPUs: 2 ranks share 1 GPU(s) on node 0 (host "),
        ("2,2,2,0", "some ranks see GPUs and others none: no GPU for rank 3 on node 1 (host "),
    ],
)
def test_every_rank_raises_the_same_error_at_start_up_across_nodes(gpus: str, says: str) -> None:
    done = run_mpi(4, [JOB, "gpus", gpus], timeout=90, hosts="nodeA:2,nodeB:2")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output  # the job caught its error on every rank: nobody hung
    said = dict(re.findall(r"^rank (\d) start-up: (.*)$", done.stdout, re.M))
    assert sorted(said) == ["0", "1", "2", "3"], output
    assert len(set(said.values())) == 1, said  # the same text everywhere
    assert said["0"].startswith(f"DeviceError: {says}"), said["0"]


@pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")
def test_gpus_are_shared_per_machine_whatever_mpigpu_node_size_splits() -> None:
    """4 ranks on one machine of 2 GPUs, split into virtual nodes of 2: each virtual node's ranks hold GPUs 0
    and 1, so only the machine's count shows that two ranks share each GPU."""
    done = run_mpi(4, [JOB, "gpus", "2,2,2,2"], timeout=90, env={"MPIGPU_NODE_SIZE": "2"})
    said = dict(re.findall(r"^rank (\d) start-up: (.*)$", done.stdout, re.M))
    assert sorted(said) == ["0", "1", "2", "3"] and len(set(said.values())) == 1, done.stdout + done.stderr
    assert said["0"].startswith("DeviceError: more ranks than GPUs: 4 ranks share 2 GPU(s) on node 0 (host "), said
