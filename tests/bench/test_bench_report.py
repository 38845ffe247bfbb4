"""The benchmark's report (mpigpu.bench.report) and its sizes, without MPI: tables, the side-by-side
table of calls and anchors, the auto summary, the closing lines, compare (old runs included), the
plot; the timing helpers of mpigpu.bench.calls; and that the report imports no MPI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from mpigpu.bench.calls import time_turn
from mpigpu.bench.main import size_list
from mpigpu.bench.report import (
    Measurement,
    PathSpec,
    auto_summary,
    compare,
    fastest_backends,
    plot,
    render_tables,
    side_by_side,
    summary_lines,
)
from mpigpu.core.timing import Result

CPU = PathSpec("cpu", "backend", "host", "mpi-host")
CPU_REQ = PathSpec("cpu", "backend", "host", "mpi-host", "persistent")
CPU_PREP = PathSpec("cpu", "backend", "host", "mpi-host", "prepared")
HOST = PathSpec("host", "backend", "host", "mpi-host")
ANCHOR = PathSpec("mpi-host", "anchor", "host")
GLOO = PathSpec("torch-gloo", "anchor", "host")
AUTO = PathSpec("auto", "auto", "host")


def m(path: PathSpec, nbytes: int, median: float, wrong: int = 0, inplace: bool = False, **extra) -> Measurement:
    result = Result(
        bytes=nbytes, elements=nbytes // 4, dtype="float32", op="sum", backend=path.name, ranks=2,
        time_us=median + 1, wrong=wrong, inplace=inplace, median_us=median, spread_us=0.5,
        per_rank_us=(median, median),
    )  # fmt: skip
    return Measurement(path, result, 10, 1, 3, 0.1, 0.01, **extra)


def test_size_list_ends_at_the_largest_size_asked_for() -> None:
    assert size_list(8, 64, 2) == [8, 16, 32, 64]
    assert size_list(8, 100, 4) == [8, 32, 100]
    assert size_list(8, 16 << 20, 4)[-3:] == [2 << 20, 8 << 20, 16 << 20]
    assert size_list(1 << 30, 1 << 30, 2) == [1 << 30]
    assert size_list(8, 9, 2) == [8, 9]


def test_tables_set_each_backend_beside_its_anchor() -> None:
    everything = [m(ANCHOR, 8, 4.0), m(ANCHOR, 16, 6.0), m(CPU, 8, 2.0), m(CPU, 16, 3.0)]
    lines = render_tables(everything[2:], everything)
    assert lines[1].startswith("# cpu  [host arrays, float32, sum]  anchor: mpi-host")
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert lines[2] == "#   user: " + CALL_USER
    assert [(r[0], r[-2], r[-1]) for r in rows] == [("8", "4.00", "2.00"), ("16", "6.00", "2.00")]
    assert lines[-1] == f"# avg busbw {sum(m.result.busbw_gbps for m in everything[2:]) / 2:.4g} GB/s"


CALL_USER = "mpigpu.allreduce(x) as users call it: checked across ranks every call (validated on its first)"


def test_paths_name_their_call_and_anchors_have_none() -> None:
    assert (CPU.call, CPU.column, CPU.label) == ("user", "cpu", "cpu (host)")
    assert (CPU_REQ.column, CPU_PREP.column, CPU_REQ.label) == ("cpu:req", "cpu:prep", "cpu:req (host)")
    assert PathSpec("mpi-host", "anchor", "host", None, "user").call is None
    assert len({CPU, CPU_REQ, CPU_PREP}) == 3
    with pytest.raises(ValueError, match="unknown call 'fast'"):
        PathSpec("cpu", "backend", "host", None, "fast")


def test_each_call_has_its_own_table_titled_with_what_is_called() -> None:
    rows = [m(ANCHOR, 8, 4.0), m(CPU, 8, 8.0), m(CPU_REQ, 8, 2.0), m(CPU_PREP, 8, 1.0)]
    lines = render_tables(rows[1:], rows)
    titles = [line for line in lines if line.startswith("# cpu")]
    assert [t.split()[1] for t in titles] == ["cpu", "cpu:req", "cpu:prep"]
    assert "#   persistent: req() of req = mpigpu.allreduce_init(x, ...) made once per size" in "\n".join(lines)
    assert any(line.startswith("#   prepared: diagnostic:") for line in lines)
    speedups = [line.split()[-1] for line in lines if not line.startswith("#")]
    assert speedups == ["0.50", "2.00", "4.00"]  # each call against the same anchor


def test_side_by_side_sets_calls_and_anchors_in_one_row_per_size() -> None:
    rows = [
        m(ANCHOR, 8, 4.0), m(GLOO, 8, 9.0), m(HOST, 8, 7.0), m(CPU, 8, 5.0), m(CPU_REQ, 8, 3.0),
        m(HOST, 16, 7.5, wrong=2), m(CPU, 16, 5.5), m(ANCHOR, 16, 4.5),
        m(AUTO, 8, 5.25, chosen="cpu"), m(PathSpec("auto", "auto", "host", None, "persistent"), 8, 3.25),
        m(CPU, 8, 6.0, inplace=True),
    ]  # fmt: skip
    lines = side_by_side(rows, "call")
    assert lines[1] == (
        "# side by side [host arrays, float32 sum, out-of-place]: median us per call of 3 interleaved rounds, "
        "slowest rank, timing call; WRONG = failed the check"
    )
    head = lines[2].split()
    assert head == ["#", "size", "bytes", "auto", "auto:req", "host", "cpu", "cpu:req", "mpi-host", "torch-gloo"]
    assert lines[3].split() == ["8", "B", "8", "5.25", "3.25", "7.00", "5.00", "3.00", "4.00", "9.00"]
    assert lines[4].split() == ["16", "B", "16", "-", "-", "WRONG", "5.50", "-", "4.50", "-"]
    assert lines[6].endswith(
        "in-place]: median us per call of 3 interleaved rounds, slowest rank, timing call; WRONG = failed the check"
    )
    assert lines[7].split()[3:] == ["cpu"] and lines[8].split()[3:] == ["6.00"]
    assert len(lines) == 9


def test_fastest_backends_compare_like_calls() -> None:
    rows = [m(CPU, 8, 5.0), m(HOST, 8, 6.0), m(CPU_REQ, 8, 4.0), m(PathSpec("host", "backend", "host", None,
            "persistent"), 8, 1.0)]  # fmt: skip
    assert fastest_backends(rows, "user")[("host", "float32", "sum", False, 8)].path == CPU
    assert fastest_backends(rows, "persistent")[("host", "float32", "sum", False, 8)].path.name == "host"
    assert fastest_backends(rows, "prepared") == {}


def test_auto_table_names_each_switch_of_backend() -> None:
    autos = [
        m(AUTO, 8, 2.0, chosen="cpu", reason="rule a", best="cpu", best_us=2.0),
        m(AUTO, 16, 3.3, chosen="host", reason="rule b", best="cpu", best_us=3.0),
    ]
    lines = render_tables(autos, autos)
    assert "# auto from 8 B: cpu (rule a)" in lines and "# auto from 16 B: host (rule b)" in lines
    assert lines[-4].split()[-4:] == ["host", "cpu", "3.00", "1.100"]


def test_auto_summary_reports_the_worst_ratio() -> None:
    autos = [
        m(AUTO, 8, 2.0, chosen="cpu", best="cpu", best_us=2.0),
        m(AUTO, 16, 3.3, chosen="host", best="cpu", best_us=3.0),
    ]
    summary = auto_summary([*autos, m(CPU, 8, 2.0)])
    assert summary is not None
    assert (summary["sizes"], summary["within_target"], summary["worst_ratio"]) == (2, 1, 1.1)
    assert summary["worst"]["bytes"] == 16 and summary["worst"]["chosen"] == "host"
    assert auto_summary([m(CPU, 8, 2.0)]) is None


def test_fastest_backends_skip_wrong_results() -> None:
    fast_but_wrong = m(HOST, 8, 1.0, wrong=1)
    best = fastest_backends([m(CPU, 8, 2.0), fast_but_wrong, m(ANCHOR, 8, 0.5), m(HOST, 16, 1.0)])
    assert {k[-1]: v.path.name for k, v in best.items()} == {8: "cpu", 16: "host"}


def test_summary_lines_pass_and_fail() -> None:
    good = [m(CPU, 8, 2.0), m(ANCHOR, 8, 2.0)]
    passed = summary_lines(good, None, ["host (host) float32 sum: no"], ["cpu: stopped after 8 B"], 2)
    assert passed == [
        "#",
        "# not timed: host (host) float32 sum: no",
        "# cpu: stopped after 8 B",
        "# PASS: 0 wrong elements in 2 checked measurements over 2 ranks",
    ]
    failed = summary_lines([*good, m(CPU, 16, 2.0, wrong=3)], None, [], [], 1)
    assert failed[-2:] == [
        "# FAIL: cpu (host) float32 sum out-of-place 16 B: 3 wrong elements",
        "# FAIL: 3 wrong elements in 3 checked measurements over 1 rank",
    ]


def test_compare_matches_rows_by_call_and_reads_old_runs_as_prepared(tmp_path: Path) -> None:
    old = m(CPU_PREP, 8, 2.0).to_dict()
    del old["call"], old["column"]  # a run written before calls were recorded: its backends were prepared calls
    a = {"ranks": 2, "results": [old, m(ANCHOR, 8, 4.0).to_dict()]}
    b = {"ranks": 2, "results": [m(CPU, 8, 9.0).to_dict(), m(CPU_PREP, 8, 3.0).to_dict(), m(ANCHOR, 8, 2.0).to_dict()]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    lines = compare(tmp_path / "a.json", tmp_path / "b.json")
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert [(r[0], r[8]) for r in rows] == [("cpu:prep", "1.500"), ("mpi-host", "0.500")]
    assert lines[-1] == "# 2 measurements in both; 0 only in A, 1 only in B"


def test_plot_draws_a_line_per_call_and_anchor(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [m(p, s, t) for p in (CPU, CPU_REQ, ANCHOR, GLOO) for s, t in ((8, 2.0), (16, 3.0))]
    doc = {"ranks": 2, "date": "2026-11-22", "results": [r.to_dict() for r in rows]}
    out = tmp_path / "p.png"
    plot(doc, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_call_timing_takes_one_sample_per_call_between_barrier_and_sync() -> None:
    events: list[str] = []
    samples = time_turn(
        lambda: events.append("call"), lambda: events.append("sync"), lambda: events.append("barrier"),
        iters=3, timing="call",
    )  # fmt: skip
    assert events == ["barrier", "call", "sync"] * 3
    assert len(samples) == 3 and all(s > 0 for s in samples)
    events.clear()
    samples = time_turn(
        lambda: events.append("call"), lambda: events.append("sync"), lambda: events.append("barrier"),
        iters=3, timing="loop",
    )  # fmt: skip
    assert events == ["barrier", "call", "call", "call", "sync"]
    assert len(samples) == 1


def test_compare_from_two_documents(tmp_path: Path) -> None:
    a = {"ranks": 2, "results": [m(CPU, 8, 2.0).to_dict(), m(CPU, 16, 4.0).to_dict()]}
    b = {"ranks": 2, "results": [m(CPU, 8, 3.0).to_dict()]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    lines = compare(tmp_path / "a.json", tmp_path / "b.json")
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert [(r[0], r[5], r[8]) for r in rows] == [("cpu", "8", "1.500")]
    assert lines[-1] == "# 1 measurements in both; 1 only in A, 0 only in B"


def test_the_report_imports_no_mpi() -> None:
    code = "import sys, mpigpu.bench.report; print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'cupy'))))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
