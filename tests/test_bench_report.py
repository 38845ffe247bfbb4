"""The benchmark's report (mpigpu.bench_report) and its sizes, without MPI: tables, the auto
summary, the closing lines, compare; and that the report imports no MPI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from mpigpu.bench import size_list
from mpigpu.bench_report import (
    Measurement,
    PathSpec,
    auto_summary,
    compare,
    fastest_backends,
    render_tables,
    summary_lines,
)
from mpigpu.timing import Result

CPU = PathSpec("cpu", "backend", "host", "mpi-host")
HOST = PathSpec("host", "backend", "host", "mpi-host")
ANCHOR = PathSpec("mpi-host", "anchor", "host")
AUTO = PathSpec("auto", "auto", "host")


def m(path: PathSpec, nbytes: int, median: float, wrong: int = 0, **extra) -> Measurement:
    result = Result(
        bytes=nbytes, elements=nbytes // 4, dtype="float32", op="sum", backend=path.name, ranks=2,
        time_us=median + 1, wrong=wrong, inplace=False, median_us=median, spread_us=0.5, per_rank_us=(median, median),
    )  # fmt: skip
    api = median + 2 if path.kind == "backend" else None
    return Measurement(path, result, api, 10, 1, 3, 0.1, 0.01, **extra)


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
    assert [(r[0], r[-3], r[-2], r[-1]) for r in rows] == [
        ("8", "4.00", "4.00", "2.00"),
        ("16", "5.00", "6.00", "2.00"),
    ]
    assert lines[-1] == f"# avg busbw {sum(m.result.busbw_gbps for m in everything[2:]) / 2:.4g} GB/s"


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
    code = "import sys, mpigpu.bench_report; print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'cupy'))))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
