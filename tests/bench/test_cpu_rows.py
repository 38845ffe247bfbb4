"""Issue 36's CPU rows: scripts/cpu_call_vs_mpi.py times each collective's user call beside the MPI
call it replaces (Allreduce, Reduce_scatter, Alltoallv, Bcast, Allgatherv), interleaved, every column
checked on exact inputs first; under mpiexec -n 2 and 3 (uneven rows), and its check without MPI.
And the Horovod layer's per-call row (scripts/hvd_call_bench.py) on CPU tensors the same way."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from conftest import load_script, run_mpi
from test_bench import YIELD

from mpigpu.cli import launcher_rank

serial = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")
SCRIPT = Path(__file__).parents[2] / "scripts" / "cpu_call_vs_mpi.py"
MPI_CALLS = {"allreduce": "comm.Allreduce", "reduce_scatter": "comm.Reduce_scatter", "alltoall": "comm.Alltoallv",
             "broadcast": "comm.Bcast", "allgather": "comm.Allgatherv"}  # fmt: skip


def _script() -> ModuleType:
    return load_script(SCRIPT)


@serial
@pytest.mark.parametrize("n", [2, 3])
def test_every_collective_beside_its_mpi_call_checked_and_interleaved(tmp_path: Path, n: int) -> None:
    out = tmp_path / "cpu.json"
    done = run_mpi(n, [str(SCRIPT), "--collective", "all", "--sizes", "8,40,4096", "--rounds", "2", "--scale", "0.01",
                       "--json", str(out)], timeout=240, env=YIELD)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["ranks"] == n and doc["order"].startswith("interleaved")
    assert list(doc["collectives"]) == list(MPI_CALLS)
    for collective, rows in doc["collectives"].items():
        assert sorted(map(int, rows)) == [8, 40, 4096]
        for row in rows.values():
            names = list(row["us"])
            assert names[0] == MPI_CALLS[collective] and 'backend="cpu"' in names and 'backend="host"' in names
            assert all(v > 0 for v in row["us"].values()) and set(row["wrong"].values()) == {0}
        assert f"# {collective}" in done.stdout
    assert "FAIL" not in done.stdout


class _Comm:
    """Enough of a communicator for a Case's arrays and expected results (no MPI call is made)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size


@pytest.mark.parametrize("collective", list(MPI_CALLS))
def test_the_check_wants_the_exact_result_of_each_collective(collective: str) -> None:
    case = _script().Case(_Comm(1, 3), collective, 40, "sum")  # 10 rows over 3 ranks: 4, 3, 3
    want = case.expected()
    size = {"allreduce": 10, "reduce_scatter": 3, "alltoall": 9, "broadcast": 10, "allgather": 30}[collective]
    assert want.shape == (size,)
    if collective == "reduce_scatter":  # rank 1's rows 4..6 of the sum of (j + 3 r) % 8 over r = 0, 1, 2
        assert want.tolist() == [float(sum((j + 3 * r) % 8 for r in range(3))) for j in (4, 5, 6)]

    def right() -> np.ndarray | None:
        if collective in ("allreduce", "broadcast"):  # in place
            case.x[:] = want
            return None
        if collective == "reduce_scatter":  # into out=o
            case.o[:] = want
            return case.o
        return want.copy()

    def wrong() -> np.ndarray | None:
        got = right()
        if got is None:
            case.x[0] += 1
            return None
        got[-1] = -1
        return got

    assert case.check("right", right) == 0
    assert case.check("wrong", wrong) == 1
    assert not case.x.any(), "the timed calls run on zeros again"
    assert case.check("nothing written", lambda: want[:-1].copy()) == size, "x unchanged, o poisoned, or too short"


# -- scripts/hvd_call_bench.py: the Horovod layer's per-call row -------------------------------------------
HVD = Path(__file__).parents[2] / "scripts" / "hvd_call_bench.py"
HVD_COLUMNS = ["hvd.allreduce(t)", "hvd.allreduce_(t)", "hvd.allreduce_async(t)+sync", "hvd.allreduce_async_(t)+sync",
               "mpigpu.allreduce(t)", "allreduce_async(t).wait()", "mpigpu.allreduce(t,out=o)",
               "mpigpu.allreduce(t.clone())", "allreduce_async(t.clone())", "comm.Allreduce"]  # fmt: skip


@serial
def test_the_horovod_rows_are_checked_and_interleaved_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "hvd.json"
    done = run_mpi(2, [str(HVD), "--sizes", "8,4K", "--rounds", "2", "--iters", "3", "--json", str(out)], timeout=240,
                   env=YIELD)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["ranks"] == 2 and doc["device"] == "cpu" and doc["rounds"] == 2
    assert doc["versions"]["torch"] and doc["date"] and doc["order"].startswith("interleaved")
    assert [r["bytes"] for r in doc["results"]] == [8, 4096]
    for row in doc["results"]:
        assert list(row["us"]) == HVD_COLUMNS and set(row["wrong"].values()) == {0}
        assert all(len(rounds) == 2 for rounds in row["rounds_us"].values())
    assert "# hvd.allreduce_(t) - mpigpu.allreduce(t): " in done.stdout
    assert "# hvd.allreduce_async_(t)+sync - allreduce_async(t).wait(): " in done.stdout
    assert "# hvd.allreduce(t) - mpigpu.allreduce(t.clone()): " in done.stdout  # the layer's own part
    assert doc["same_op"]["hvd.allreduce_async(t)+sync"] == "allreduce_async(t.clone())"
    for row in doc["results"]:  # each difference also as the median of the per-round ones
        rounds = row["rounds_us"]
        per_round = sorted(
            a - b for a, b in zip(rounds["hvd.allreduce_(t)"], rounds["mpigpu.allreduce(t)"], strict=True)
        )
        assert row["paired_us"]["hvd.allreduce_(t) - mpigpu.allreduce(t)"] == pytest.approx(sum(per_round) / 2)


@serial
def test_the_horovod_rows_on_gpus_say_there_is_none_here() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal cannot be seen")
    done = run_mpi(2, [str(HVD), "--device", "gpu"], timeout=120)
    assert done.returncode == 2 and "--device gpu needs a GPU on every rank" in done.stderr


def test_the_horovod_check_sees_a_wrong_result_and_a_touched_input() -> None:
    torch = pytest.importorskip("torch")
    module = load_script(HVD)
    columns = object.__new__(module.Columns)  # no Horovod needed to check a call
    columns.torch, columns.rank, columns.n, columns.count = torch, 0, 2, 6
    columns.t = torch.zeros(6)
    mean = torch.from_numpy((columns._input(0) + columns._input(1)) / np.float32(2))
    columns.calls = {
        "hvd.allreduce_(t)": (lambda: columns.t.copy_(mean), "avg"),  # right, in place
        "mpigpu.allreduce(t)": (lambda: columns.t.copy_(mean * 2), "avg"),  # the sum: every element wrong
        "hvd.allreduce(t)": (lambda: mean.clone(), "avg"),  # right, a new tensor, t untouched
        "hvd.allreduce_async(t)+sync": (lambda: columns.t.copy_(mean).clone(), "avg"),  # right, but t written
    }
    assert columns.check("hvd.allreduce_(t)") == 0
    assert columns.check("mpigpu.allreduce(t)") == 6
    assert columns.check("hvd.allreduce(t)") == 0
    assert columns.check("hvd.allreduce_async(t)+sync") == 1
    assert not columns.t.any(), "the timed calls run on zeros again"
