"""``python -m mpigpu.bench --collective broadcast|allgather`` on the CPU path under mpiexec -n 1, 2,
4: every row (the user's call per backend and auto, the MPI and gloo anchors) verified and in the
JSON with its collective and nccl-tests' bus bandwidth, a damaged result caught, the options that
mean nothing for a collective refused; and, without MPI, the byte-exact verifier of
``mpigpu.bench.collectives`` catching each way a result can be wrong.

The mpiexec tests are serial tests: each one launches the command through ``run_mpi``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_mpi
from test_bench import QUICK, YIELD, bench, has_torch_gloo, ok

from mpigpu.bench.collectives import CollectiveResult, CollectiveWorkload, _pattern, busbw_factor
from mpigpu.cli import launcher_rank
from mpigpu.core.dtypes import DTYPES

serial = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")
MOVES = ["broadcast", "allgather"]


# -- the command -----------------------------------------------------------------------------------
@serial
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("collective", MOVES)
def test_each_collective_runs_verified_with_its_anchors(tmp_path: Path, n: int, collective: str) -> None:
    out = tmp_path / "run.json"
    done = ok(bench(n, tmp_path, "--collective", collective, "--sizes", "8,40,4K", "--dtypes", "float32,int8",
                    "--backends", "auto,cpu,host,ipc,mpi-host,torch-gloo", "--json", str(out)))  # fmt: skip
    assert "# PASS: 0 wrong elements" in done.stdout
    assert f"# cpu  [host arrays, float32, {collective}]  anchor: mpi-host" in done.stdout
    call = "mpigpu.broadcast(x, root=0)" if collective == "broadcast" else "mpigpu.allgather(x)"
    assert f"# call user: {call} as users call it" in done.stdout
    assert "ipc: does not implement" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["collective"] == collective and doc["settings"]["collective"] == collective
    into = collective == "allgather"  # mpigpu.allgather takes out=: also timed into an output made once
    assert doc["settings"]["calls"] == (["user", "out"] if into else ["user"])
    rows = doc["results"]
    columns = {r["column"] for r in rows}
    outs = ["cpu:out", "host:out", "auto:out"] if into else []
    assert {"cpu", "host", "auto", "mpi-host", *outs, *(["torch-gloo"] if has_torch_gloo() else [])} == columns
    for column in columns:  # every path at every size and dtype, once (the collective's one mode)
        mine = sorted((r["dtype"], r["bytes"]) for r in rows if r["column"] == column)
        assert mine == sorted((d, s) for d in ("float32", "int8") for s in (8, 40, 4096)), column
    for row in rows:
        assert row["collective"] == collective and row["wrong"] == 0 and row["ok"] is True
        assert row["inplace"] is (collective == "broadcast")
        assert row["bytes"] == row["elements"] * DTYPES[row["dtype"]].itemsize  # each rank's input
        assert row["out_bytes"] == row["bytes"] * (n if collective == "allgather" else 1)
        assert row["algbw_gbps"] == pytest.approx(row["out_bytes"] / (row["time_us"] * 1e3), abs=2e-4)
        factor = 0.0 if n == 1 else 1.0 if collective == "broadcast" else (n - 1) / n
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor, abs=2e-4)
    assert {r["chosen"] for r in rows if r["kind"] == "auto"} <= {"cpu", "host"}
    assert all(r["anchor"] == "mpi-host" for r in rows if r["kind"] == "backend")


@serial
@pytest.mark.parametrize("collective", MOVES)
def test_a_wrong_result_is_caught_in_every_row(tmp_path: Path, collective: str) -> None:
    out = tmp_path / "bad.json"
    done = ok(bench(2, tmp_path, "--collective", collective, "--sizes", "8,40", "--corrupt", "2",
                    "--json", str(out)), 1)  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["results"]
    assert all(r["wrong"] == 2 for r in doc["results"]), [(r["column"], r["wrong"]) for r in doc["results"]]
    mode = "in-place" if collective == "broadcast" else "out-of-place"
    assert f"# FAIL: cpu (host) float32 {collective} {mode} 40 B: 2 wrong elements" in done.stdout


# One-time set-up at the second size (as a CUB reduction kernel compiled there on the GPU machine):
# the first check of that size sleeps, every later one is quick.
_SLOW_ONCE = """
import sys, time
from mpigpu.bench import collectives as bench_collectives
from mpigpu.bench import main as bench

fill, slept = bench_collectives.CollectiveWorkload.fill, []

def slow_once(self):
    if self.count == 16 and not slept:
        slept.append(1)
        time.sleep(float(sys.argv[1]))
    fill(self)

bench_collectives.CollectiveWorkload.fill = slow_once
sys.exit(bench.main(sys.argv[2:]))
"""


@serial
@pytest.mark.parametrize("collective", MOVES)
def test_one_time_set_up_at_the_second_size_does_not_stop_the_sweep(tmp_path: Path, collective: str) -> None:
    # 0.3 s at 64 B, times the growth to 4 KiB (64), predicts ~19 s: over the limit of 3 s, while
    # the size itself took well under it. Before the fix the sweep stopped after 64 B.
    out = tmp_path / "slow.json"
    args = ["-c", _SLOW_ONCE, "0.3", *QUICK, "--collective", collective, "--sizes", "8,64,4K", "--backends", "cpu",
            "--time-limit", "3", "--json", str(out)]  # fmt: skip
    done = ok(run_mpi(2, args, timeout=240, env={"MPIGPU_TUNE_FILE": str(tmp_path / "tune.json"), **YIELD}))
    doc = json.loads(out.read_text())
    assert doc["stopped"] == [], doc["stopped"]
    assert "stopped after" not in done.stdout
    for column in ("mpi-host", "cpu"):  # the first path timed (the anchor) met the slow set-up
        assert [r["bytes"] for r in doc["results"] if r["column"] == column] == [8, 64, 4096], column
    assert all(r["wrong"] == 0 for r in doc["results"])


@serial
@pytest.mark.parametrize("collective", MOVES)
def test_a_check_that_stays_slow_still_stops_the_sweep(tmp_path: Path, collective: str) -> None:
    # the same sleep at the second size on every check: the re-check is slow too, so the sweep stops
    out = tmp_path / "slow.json"
    always = _SLOW_ONCE.replace("and not slept", "")
    args = ["-c", always, "0.3", *QUICK, "--collective", collective, "--sizes", "8,64,4K", "--backends", "cpu",
            "--time-limit", "3", "--json", str(out)]  # fmt: skip
    done = ok(run_mpi(2, args, timeout=240, env={"MPIGPU_TUNE_FILE": str(tmp_path / "tune.json"), **YIELD}))
    doc = json.loads(out.read_text())
    mode = "in-place" if collective == "broadcast" else "out-of-place"
    paths = "mpi-host, cpu, cpu:out" if collective == "allgather" else "mpi-host, cpu"
    assert f"host float32 {collective} {mode} ({paths}): stopped after 64 B (the next would take" in done.stdout
    for column in ("mpi-host", "cpu"):
        assert [r["bytes"] for r in doc["results"] if r["column"] == column] == [8, 64], column


@serial
@pytest.mark.skipif(not has_torch_gloo(), reason="torch with gloo is not installed")
def test_torch_tensors_as_the_users_arrays(tmp_path: Path) -> None:
    out = tmp_path / "torch.json"
    done = ok(bench(2, tmp_path, "--collective", "allgather", "--framework", "torch", "--sizes", "8,4K", "--dtypes",
                    "float32,int64", "--backends", "cpu,auto,torch-gloo", "--json", str(out)))  # fmt: skip
    assert "# arrays passed to allgather: torch tensors" in done.stdout
    doc = json.loads(out.read_text())
    columns = {"cpu", "auto", "cpu:out", "auto:out", "mpi-host", "torch-gloo"}  # cpu brings its anchor
    assert {r["column"] for r in doc["results"]} == columns
    assert all(r["wrong"] == 0 for r in doc["results"])


@serial
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--collective", "broadcast", "--ops", "avg"], "--collective broadcast reduces nothing: leave out --ops"),
        (["--collective", "allgather", "--calls", "user,persistent"], "times the user's call only"),
        (["--collective", "allgather", "--inplace"], "--inplace does not apply to --collective allgather"),
        (["--collective", "broadcast", "--out-of-place"], "--out-of-place does not apply to --collective broadcast"),
        (["--collective", "broadcast", "--tune"], "--tune measures allreduce's crossover table"),
        (["--collective", "scatter"], "unknown collective 'scatter'"),
        (["--collective", "all", "--json", "x.json"], "with several collectives use --json-dir DIR"),
        (["--collective", "allreduce,broadcast", "--tune"], "run it with --collective allreduce alone"),
        (["--collective", "allreduce", "--calls", "out"], "--calls out is allgather's and alltoall's"),
    ],
)
def test_options_without_meaning_for_a_collective_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    done = ok(bench(2, tmp_path, *args), 2)
    assert message in done.stderr
    assert done.stderr.count("error:") == 1, "one message per job, not one per rank"


@serial
def test_allreduce_stays_the_default(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    ok(bench(1, tmp_path, "--sizes", "8", "--backends", "cpu", "--json", str(out)))
    doc = json.loads(out.read_text())
    assert doc["collective"] == "allreduce" and doc["settings"]["calls"] == ["user", "persistent"]
    assert {r["op"] for r in doc["results"]} == {"sum"} and all("collective" not in r for r in doc["results"])


# -- the verifier, without MPI ----------------------------------------------------------------------
def _workload(collective: str, rank: int, nranks: int, count: int = 6) -> CollectiveWorkload:
    work = CollectiveWorkload.allocate(collective, count, DTYPES["float32"], rank, nranks, None, None)
    work.fill()
    work.poison()
    return work


def _expected(work: CollectiveWorkload, rank: int) -> np.ndarray:
    return _pattern(np, work.count * work.dtype.itemsize, rank, work.salt)


def test_patterns_differ_between_ranks_at_every_byte_and_are_never_the_poison() -> None:
    blocks = [_pattern(np, 4096, rank, 5) for rank in range(8)]
    for a in range(8):
        assert 0xFF not in blocks[a]
        for b in range(a):
            assert np.all(blocks[a] != blocks[b]), (a, b)
    assert np.all(_pattern(np, 4096, 3, 5) != _pattern(np, 4096, 3, 6)), "a new check expects new bytes"


def test_broadcast_verifier_wants_the_roots_bytes_on_every_rank() -> None:
    work = _workload("broadcast", rank=2, nranks=3)
    assert work.wrong() == work.count, "a rank that kept its own input is wrong everywhere"
    work.x.host.view(np.uint8)[:] = _expected(work, 0)
    assert work.wrong() == 0
    work.x.host.view(np.uint8)[5] ^= 1  # one byte of element 1
    assert work.wrong() == 1


def test_allgather_verifier_catches_order_stale_results_poison_and_size() -> None:
    nranks = 3
    work = _workload("allgather", rank=1, nranks=nranks)
    assert work.wrong() == work.count * nranks, "no result at all"
    right = np.concatenate([_expected(work, r) for r in range(nranks)]).view(np.float32)
    work.result = right.copy()
    assert work.wrong() == 0
    swapped = np.concatenate([_expected(work, r) for r in (1, 0, 2)]).view(np.float32)
    work.result = swapped
    assert work.wrong() == 2 * work.count, "blocks in the wrong rank order"
    stale = right.copy()
    work.fill()  # the next check: the previous, correct output must not pass
    work.result = stale
    assert work.wrong() == work.count * nranks
    work.result = work.out.host  # the anchors' output, poisoned and never written
    assert work.wrong() == work.count * nranks
    work.result = np.zeros(work.count, np.float32)  # one rank's worth instead of n ranks'
    assert work.wrong() == work.count * nranks


def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert busbw_factor("allreduce", 4) == 1.5 and busbw_factor("broadcast", 4) == 1.0
    assert busbw_factor("allgather", 4) == 0.75 and busbw_factor("allgather", 1) == 0.0
    fields = {"bytes": 1000, "elements": 250, "dtype": "float32", "op": "none", "backend": "nccl", "ranks": 4,
              "time_us": 1.0, "wrong": 0}  # fmt: skip
    gather = CollectiveResult(**fields, collective="allgather")
    assert gather.algbw_gbps == pytest.approx(4.0) and gather.busbw_gbps == pytest.approx(3.0)  # output bytes
    bcast = CollectiveResult(**fields, collective="broadcast")
    assert bcast.algbw_gbps == pytest.approx(1.0) and bcast.busbw_gbps == pytest.approx(1.0)


# -- reduce_scatter and alltoall ----------------------------------------------------------------------
SPLIT = ["reduce_scatter", "alltoall"]


@serial
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("collective", SPLIT)
def test_reduce_scatter_and_alltoall_run_verified_with_their_anchors(tmp_path: Path, n: int, collective: str) -> None:
    out = tmp_path / "run.json"
    done = ok(bench(n, tmp_path, "--collective", collective, "--sizes", "8,40,4K", "--dtypes", "float32,int8,float16",
                    "--backends", "auto,cpu,host,ipc,mpi-host,torch-gloo", "--json", str(out)))  # fmt: skip
    assert "# PASS: 0 wrong elements" in done.stdout
    call = 'mpigpu.reduce_scatter(x, "sum", out=o)' if collective == "reduce_scatter" else "mpigpu.alltoall(x)"
    assert f"# call user: {call} as users call it" in done.stdout
    # ipc reduce-scatters (its allreduce, then the rows) but needs GPUs; it has no alltoall
    assert ("ipc: does not implement" in done.stdout) == (collective == "alltoall")
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["collective"] == collective
    rows = doc["results"]
    anchors = {"mpi-host", *(["torch-gloo"] if has_torch_gloo() and collective == "alltoall" else [])}
    outs = {"cpu:out", "host:out", "auto:out"} if collective == "alltoall" else set()  # alltoall takes out=
    assert {r["column"] for r in rows} == {"cpu", "host", "auto", *anchors, *outs}
    if collective == "reduce_scatter":  # MPI has no float16, gloo no reduce-scatter: said, not timed
        assert "not timed: mpi-host (host) float16 sum: MPI has no float16 type" in done.stdout
        if has_torch_gloo():
            assert "gloo has no reduce-scatter" in done.stdout
    for row in rows:
        assert row["collective"] == collective and row["wrong"] == 0 and row["ok"] is True and not row["inplace"]
        share = -(-row["elements"] // n) * DTYPES[row["dtype"]].itemsize  # rank 0's, the largest
        assert row["out_bytes"] == (share if collective == "reduce_scatter" else share * n)
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e3), abs=2e-4)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * (n - 1) / n, abs=2e-4)


@serial
@pytest.mark.parametrize("collective", SPLIT)
def test_a_wrong_reduce_scatter_or_alltoall_is_caught(tmp_path: Path, collective: str) -> None:
    out = tmp_path / "bad.json"
    done = ok(bench(2, tmp_path, "--collective", collective, "--sizes", "40,4K", "--corrupt", "2",
                    "--backends", "cpu,host,mpi-host", "--json", str(out)), 1)  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["results"]
    assert all(r["wrong"] == 2 for r in doc["results"]), [(r["column"], r["wrong"]) for r in doc["results"]]
    assert f"# FAIL: cpu (host) float32 {collective} out-of-place 40 B: 2 wrong elements" in done.stdout


@serial
def test_reduce_scatter_takes_sum_only(tmp_path: Path) -> None:
    done = ok(bench(2, tmp_path, "--collective", "reduce_scatter", "--ops", "max"), 2)
    assert "--collective reduce_scatter is timed and verified with op sum" in done.stderr


def test_reduce_scatter_verifier_wants_this_ranks_share_of_the_sum() -> None:
    from mpigpu.bench.collectives import _values

    nranks, rank, count = 3, 1, 7  # shares 3, 2, 2: rank 1 has elements 3 and 4
    work = _workload("reduce_scatter", rank=rank, nranks=nranks, count=count)
    assert work.wrong() == 2, "no result"
    total = sum(_values(np, count, r, work.salt) for r in range(nranks)).astype(np.float32)
    work.result = total[3:5].copy()
    assert work.wrong() == 0
    work.result = total[0:2].copy()  # another rank's share
    assert work.wrong() == 2
    stale = sum(_values(np, count, r, work.salt - 1) for r in range(nranks)).astype(np.float32)
    work.result = stale[3:5].copy()  # the previous check's sum
    assert work.wrong() >= 1
    work.result = total[3:6].copy()  # the wrong size
    assert work.wrong() == 2


def test_alltoall_verifier_wants_every_ranks_share_in_rank_order() -> None:
    nranks, rank, count = 3, 2, 7  # splits 3, 2, 2: rank 2 receives bytes 5..6 of every rank's input, 2 each
    work = _workload("alltoall", rank=rank, nranks=nranks, count=count)
    item = work.dtype.itemsize
    blocks = [_expected(work, r)[5 * item : 7 * item] for r in range(nranks)]
    work.result = np.concatenate(blocks).view(np.float32).copy()
    assert work.wrong() == 0
    work.result = np.concatenate(blocks[::-1]).view(np.float32).copy()  # rank order reversed
    assert work.wrong() == 4
    work.result = np.concatenate([_expected(work, r)[0 : 2 * item] for r in range(nranks)]).view(np.float32)
    assert work.wrong() == 6, "another rank's share"
