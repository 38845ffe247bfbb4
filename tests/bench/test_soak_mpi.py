"""The soak test (mpigpu.bench.soak) on the CPU path: a few hundred random calls under mpiexec -n 1, 2 and 4,
every element verified exactly, memory bounded; a damaged result is caught; the command's output,
JSON and exit status; the argument-check cost mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_mpi

from mpigpu.bench.soak import _agree_seed, build_parser, report, run_soak


@pytest.mark.mpi(min_size=1)
def test_soak_random_calls_all_verified(comm) -> None:
    args = build_parser().parse_args(["--calls", "300", "--max-size", "4K", "--seed", "2024"])
    result = run_soak(args, progress=False)
    assert result.ok, result.failures
    assert result.wrong == 0 and result.failures == []
    assert result.calls + result.skipped == 300 and result.calls > 250
    assert result.warm_up >= 2, "one largest-size call per backend, in place and out of place"
    layout = result.counts["layout"]
    assert layout["in place"] > 50 and layout["out of place"] > 50 and layout["offset"] > 50
    assert set(result.counts["requested"]) >= {"auto", "cpu"}
    assert all(growth <= result.bound for growth in result.growth.values())
    assert result.seed == 2024
    # every rank drew the same calls and saw the same totals
    assert len(set(comm.allgather((result.calls, result.wrong, json.dumps(result.counts))))) == 1


@pytest.mark.mpi(min_size=1)
def test_every_variant_runs_in_the_warm_up_and_rank_0_reports_its_rss(comm) -> None:
    """Memory is measured only after each variant (placement x backend run x dtype x op) has run once:
    a kernel loaded (NVRTC with it) for a variant first met later is not counted as growth. Rank 0
    reports its RSS after the warm-up, at each variant a random call meets first, and at the end."""
    argv = ["--calls", "120", "--max-size", "1K", "--seed", "7", "--dtypes", "float32,int8", "--ops", "sum,max"]
    full = run_soak(build_parser().parse_args(argv), progress=False)
    assert full.ok, full.failures
    assert full.warm_up >= 2 + 2 * 2 * 2, "two calls per dtype x op besides the largest ones"
    only_largest = run_soak(build_parser().parse_args([*argv, "--warm-up", "largest"]), progress=False)
    assert only_largest.ok, only_largest.failures
    if comm.Get_rank() != 0:
        assert full.rss_trace == [] and only_largest.rss_trace == []
        return
    marks = [mark.at for mark in full.rss_trace]
    assert marks[0].startswith("after warm-up") and marks[-1] == "at the end" and len(marks) == 2, marks
    assert all(mark.rss > 0 for mark in full.rss_trace)
    firsts = [mark.at for mark in only_largest.rss_trace[1:-1]]
    assert firsts and all(": first " in at for at in firsts), "the random calls meet int8 and max first"
    assert any("int8" in at for at in firsts) and any(" max " in at for at in firsts), firsts
    text = report(only_largest)
    assert text.count("# rss       ") == len(only_largest.rss_trace) and "# rss       after warm-up" in text


@pytest.mark.mpi(min_size=1)
def test_soak_catches_a_damaged_result(comm) -> None:
    args = build_parser().parse_args(["--calls", "20", "--max-size", "1K", "--seed", "5", "--corrupt", "4"])
    result = run_soak(args, progress=False)
    assert not result.ok
    assert result.wrong == 1, "exactly the one element damaged on rank 0"
    assert len(result.failures) == 1 and result.failures[0].startswith("rank 0: ")


@pytest.mark.mpi(min_size=2)
def test_seed_is_drawn_once_and_shared(comm) -> None:
    seeds = comm.allgather(_agree_seed(comm, None))
    assert len(set(seeds)) == 1
    assert comm.allgather(_agree_seed(comm, 17)) == [17] * comm.Get_size()


def test_soak_command_passes_and_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "soak.json"
    result = run_mpi(
        2, ["-m", "mpigpu.bench.soak", "--calls", "200", "--max-size", "2K", "--json", str(path)], timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# soak: seed " in result.stdout and "# PASS: seed" in result.stdout
    assert "# wrong     0 elements" in result.stdout and "[soak] 200/200 calls" in result.stderr
    document = json.loads(path.read_text())
    assert document["ok"] and document["wrong"] == 0 and document["calls"] + document["skipped"] == 200
    assert document["ranks"] == 2 and document["before"]["rss"] > 0 and "rss" in document["growth"]


def test_soak_command_fails_on_a_wrong_element() -> None:
    result = run_mpi(2, ["-m", "mpigpu.bench.soak", "--calls", "20", "--max-size", "1K", "--corrupt", "3"], timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "# FAIL: seed" in result.stdout and "1 wrong elements" in result.stdout


def test_soak_same_seed_same_run() -> None:
    runs = [
        run_mpi(
            2, ["-m", "mpigpu.bench.soak", "--calls", "60", "--max-size", "1K", "--seed", "99", "--quiet"], timeout=60
        )
        for _ in range(2)
    ]
    mixes = [next(line for line in r.stdout.splitlines() if line.startswith("# mix")) for r in runs]
    assert mixes[0] == mixes[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--calls", "0"], "too small"),
        (["--backends", "nccl,mpi"], "unknown backend 'mpi'"),
        (["--dtypes", "complex64"], "unknown dtype 'complex64'"),
        (["--max-size", "lots"], "invalid size 'lots'"),
    ],
)
def test_soak_bad_options_exit_2(args: list[str], message: str) -> None:
    result = run_mpi(2, ["-m", "mpigpu.bench.soak", *args], timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_check_cost_mode_prints_a_row_per_backend() -> None:
    result = run_mpi(2, ["-m", "mpigpu.bench.soak", "--check-cost", "--iters", "50", "--repeats", "2"], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "argument check (MPIGPU_CHECK) cost" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("  host")]
    assert {row[1] for row in rows} >= {"auto", "cpu"}
    assert all(row[2] == "8" and float(row[3]) > 0 and float(row[4]) > 0 for row in rows)
