"""MPIGPU_TIMELINE in real jobs (each test starts its own mpiexec: the setting is read at start-up)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, mpiexec, run_mpi

from mpigpu.timeline.report import analyse, format_report
from mpigpu.timeline.traces import load, load_any

CALLS = """
import sys, time
import numpy as np
import mpigpu
from mpigpu.core import timeline
from mpigpu.core._mpi import world

rank = world().Get_rank()
x = np.ones(2, np.float32)
for i in range(6):
    if i == 3 and rank == world().Get_size() - 1:
        time.sleep(0.3)  # the last rank arrives late at call 3
    mpigpu.allreduce(x)
req = mpigpu.allreduce_init(x)
req()
req.start()
req.wait()
print(f"rank {rank} on={timeline.on}")
"""

TRAIN = """
import sys
import torch
import mpigpu

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
avg = mpigpu.BackwardAverager(model, optimizer=opt, bucket_bytes=20_000, first_bucket_bytes=2_000)
for step in range(3):
    opt.zero_grad(set_to_none=False)
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
sys.stdout.write(f"buckets {len(avg.buckets)}\\n")  # one write: the ranks' lines do not interleave
avg.close()
"""


def _job(
    tmp_path: Path, n: int, code: str, env: dict[str, str], hosts: str | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(code)
    done = run_mpi(n, [str(script)], timeout=120, env=env, hosts=hosts)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_writes_its_calls_and_the_late_rank_is_named(tmp_path: Path, n: int) -> None:
    directory = tmp_path / "tl"
    _job(tmp_path, n, CALLS, {"MPIGPU_TIMELINE": str(directory)})
    assert sorted(p.name for p in directory.iterdir()) == [f"rank{r}.json" for r in range(n)]
    ranks = load(directory)
    for r in ranks:
        calls = [e for e in r.events if e["kind"] == "call"]
        assert [(e["name"], e["seq"]) for e in calls] == [("allreduce", s) for s in range(6)] + [
            ("allreduce start", 6), ("allreduce start", 7)]  # fmt: skip
        for e in calls:
            m = e["marks"]
            assert m["begin"] <= m.get("checked", m["begin"]) <= m["launched"] <= m["done"], e
        assert all("checked" in e["marks"] for e in calls[1:6])  # repeated calls check in their record's call
    report = analyse(ranks)
    assert len(report.matched) == 8 and report.unmatched == 0
    late = next(m for m in report.matched if m.key[2] == 3)
    assert late.last == n - 1
    assert min(late.waits[:-1]) > 0.2e9  # the others waited about the 0.3 s it slept
    worst = max(report.matched, key=lambda m: sum(m.waits))
    assert worst is late
    assert "allreduce #3" in format_report(report)


def test_across_mpi_nodes_the_merged_trace_names_each_ranks_node(tmp_path: Path) -> None:
    """Issue 45: at 2x2 (MPI's own nodes: MPICH's fork launcher with named hosts) every rank's file
    holds its node, and the merged trace names it beside the host."""
    directory = tmp_path / "tl"
    _job(tmp_path, 4, CALLS, {"MPIGPU_TIMELINE": str(directory)}, hosts="nodeA:2,nodeB:2")
    ranks = load(directory)
    assert [(r.rank, r.node) for r in ranks] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    trace = tmp_path / "trace.json"
    merged = subprocess.run([sys.executable, "-m", "mpigpu.timeline", "merge", str(directory), "-o", str(trace)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)  # fmt: skip
    assert merged.returncode == 0, merged.stdout + merged.stderr
    doc = json.loads(trace.read_text())
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    host = socket.gethostname()
    assert names == {r: f"rank {r} (node {r // 2}, host {host})" for r in range(4)}
    assert [r["node"] for r in doc["mpigpu"]["ranks"]] == [0, 0, 1, 1]  # plot reads the merged trace too
    assert len(analyse(load_any(trace)).matched) == 8


def test_the_ring_bound_is_honoured_per_rank(tmp_path: Path) -> None:
    directory = tmp_path / "tl"
    _job(tmp_path, 2, CALLS, {"MPIGPU_TIMELINE": str(directory), "MPIGPU_TIMELINE_EVENTS": "3"})
    for path in sorted(directory.iterdir()):
        doc = json.loads(path.read_text())
        assert doc["recorded"] == 8 and doc["dropped"] == 5 and len(doc["events"]) == 3
        assert [e["seq"] for e in doc["events"]] == [5, 6, 7]


def test_off_records_nothing_and_writes_nothing(tmp_path: Path) -> None:
    done = _job(tmp_path, 2, CALLS, {})
    assert "rank 0 on=False" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py"]


def test_a_setting_on_one_rank_only_fails_every_rank(tmp_path: Path) -> None:
    """Whether the timeline is on is agreed: its start-up exchanges clocks on every rank."""
    script = tmp_path / "job.py"
    script.write_text(CALLS)
    launcher = mpiexec()
    command = [launcher, "-n", "1", "-env", "MPIGPU_TIMELINE", str(tmp_path / "tl"), sys.executable, str(script),
               ":", "-n", "1", sys.executable, str(script)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert done.returncode != 0
    assert "MPIGPU_TIMELINE: 1 on rank 0; unset on rank 1" in done.stderr, done.stderr


def test_backward_averager_records_buckets_backward_and_steps(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the BackwardAverager needs torch (the test extra installs the CPU build)")
    directory = tmp_path / "tl"
    done = _job(tmp_path, 2, TRAIN, {"MPIGPU_TIMELINE": str(directory)})
    nbuckets = int(re.findall(r"buckets (\d+)", done.stdout)[0])
    assert nbuckets >= 2
    ranks = load(directory)
    for r in ranks:
        buckets = [e for e in r.events if e["kind"] == "bucket"]
        assert len(buckets) == 3 * nbuckets
        assert sorted({(e["step"], e["bucket"]) for e in buckets}) == [
            (s, b) for s in range(3) for b in range(nbuckets)
        ]
        for e in buckets:
            m = e["marks"]
            assert m["ready"] <= m["launch"] <= m["launched"] <= m["done"], e
        backward = [e for e in r.events if e["lane"] == "backward"]
        assert [e["step"] for e in backward] == [0, 1, 2]
        for e in backward:
            assert e["marks"]["begin"] <= e["marks"]["end"]
            # every bucket of the step became ready inside backward (its last gradient arrived there)
            for b in (b for b in buckets if b["step"] == e["step"]):
                assert e["marks"]["begin"] <= b["marks"]["ready"] <= e["marks"]["end"]
        steps = [(e["name"], e["step"]) for e in r.events if e["lane"] == "step"]
        assert sorted(steps) == sorted([("finish", s) for s in range(3)] + [("optimizer step", s) for s in range(3)])
    report = analyse(ranks)
    assert sum(1 for m in report.matched if m.key[0] == "bucket") == 3 * nbuckets
    assert report.hidden is not None and report.hidden.steps == 3
    assert all(total > 0 for total in report.hidden.total_ms)
    assert "hidden" in format_report(report)


FIVE = """
import numpy as np
import mpigpu
from mpigpu.core._mpi import world

n = world().Get_size()
x = np.ones((2 * n, 2))
mpigpu.allreduce(x)
mpigpu.reduce_scatter(x)
mpigpu.alltoall(x)
mpigpu.broadcast(x)
mpigpu.allgather(x)
mpigpu.reduce_scatter_async(x).wait()
"""


def test_every_collective_of_the_road_is_recorded_with_its_check(tmp_path: Path) -> None:
    """Every family runs through one road, so every collective (and its async form) is on the timeline,
    the first call with new arguments included (its check runs where a repeated call's does)."""
    directory = tmp_path / "tl"
    _job(tmp_path, 2, FIVE, {"MPIGPU_TIMELINE": str(directory)})
    for r in load(directory):
        calls = [e for e in r.events if e["kind"] == "call"]
        assert [e["name"] for e in calls] == [
            "allreduce", "reduce_scatter", "alltoall", "broadcast", "allgather", "reduce_scatter"]  # fmt: skip
        assert all("checked" in e["marks"] for e in calls)
