"""The benchmark (python -m mpigpu.bench) on the CPU path under mpiexec -n 1 to 4: tables, JSON,
plot, compare, tuning and auto, the rows of each call (user, persistent, prepared), the torch.distributed
(gloo) anchor, torch tensors as the user's arrays, the exit status on a wrong element and on bad
options. Plus the crossover-table logic of mpigpu.runtime.tuning, which needs no MPI.

These are serial tests: each one launches the command through ``run_mpi``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, run_mpi

from mpigpu.cli import launcher_rank
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import ConfigError
from mpigpu.runtime.tuning import (
    Sample,
    TuningTable,
    bands_from_samples,
    best_per_size,
    describe_bands,
    signature_key,
    write_entry,
)

# These tests start mpiexec themselves: under a launcher (the MPI passes of scripts/test.sh, where
# pytest-mpi 0.6 runs unmarked tests too) they would nest jobs on every rank.
pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

QUICK = ["--iters", "2", "--rounds", "2", "--warmup", "1"]
PNG = b"\x89PNG\r\n\x1a\n"
# MPICH busy-polls; with more ranks than cores (CI) yielding makes each call ~10x faster. Other MPIs ignore it.
YIELD = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}


def bench(n: int, tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the benchmark on ``n`` ranks with a private tuning file (unless ``env`` names one)."""
    full_env = {"MPIGPU_TUNE_FILE": str(tmp / "tune.json"), **YIELD, **(env or {})}
    return run_mpi(n, ["-m", "mpigpu.bench", *QUICK, *args], timeout=240, env=full_env)


def ok(done: subprocess.CompletedProcess[str], code: int = 0) -> subprocess.CompletedProcess[str]:
    assert done.returncode == code, f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done


def key(row: dict[str, Any]) -> tuple:
    return (row["placement"], row["dtype"], row["op"], row["inplace"], row["bytes"])


def has_torch_gloo() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# -- the sweep, its table and its JSON ------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4])
def test_sweep_prints_tables_and_writes_consistent_json(tmp_path: Path, n: int) -> None:
    out = tmp_path / "run.json"
    done = ok(
        bench(n, tmp_path, "-b", "8", "-e", "64", "--dtypes", "float32,int32", "--ops", "sum,avg", "--json", str(out))
    )
    assert "# cpu  [host arrays, float32, sum]  anchor: mpi-host" in done.stdout
    assert "#wrong" in done.stdout and "busbw" in done.stdout
    assert "# PASS: 0 wrong elements" in done.stdout
    assert "[bench] cpu host int32 avg in-place 64 B (4/4)" in done.stderr  # progress, one line per size

    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["ranks"] == n and doc["failures"] == []
    assert doc["command"][1:3] == ["-m", "mpigpu.bench"]
    assert {"hostname", "gpu_model", "gpu_count", "topology", "nvidia_smi_topo", "signature"} <= set(doc["machine"])
    assert {"mpi", "mpi_library", "nccl", "cuda", "numpy", "mpi4py"} <= set(doc["versions"])
    assert doc["date"] and doc["settings"]["sizes"] == [8, 16, 32, 64]
    rows = doc["results"]
    by_path: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_path.setdefault(row["path"], []).append(row)
        assert row["wrong"] == 0 and row["ok"] is True
        assert row["bytes"] == row["elements"] * DTYPES[row["dtype"]].itemsize
        assert row["time_us"] > 0 and row["median_us"] > 0 and row["spread_us"] >= 0
        assert len(row["per_rank_us"]) == n and max(row["per_rank_us"]) == pytest.approx(row["time_us"])
        factor = 2 * (n - 1) / n
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor, abs=2e-4)
        assert row["iters"] == 2 and row["repeats"] == row["rounds"] == 2 and len(row["rounds_us"]) == 2
    assert {"cpu", "mpi-host"} <= set(by_path)
    expected = {(d, o, m, s) for d in ("float32", "int32") for o in ("sum", "avg") for m in (True, False)
                for s in (8, 16, 32, 64)}  # fmt: skip
    names = ["mpi-host", *(["torch-gloo"] if has_torch_gloo() else [])]
    for name in names:
        assert {(r["dtype"], r["op"], r["inplace"], r["bytes"]) for r in by_path[name]} == expected
    for call in ("user", "persistent"):  # the default calls, each a row of its own at every size
        mine = {(r["dtype"], r["op"], r["inplace"], r["bytes"]) for r in by_path["cpu"] if r["call"] == call}
        assert mine == expected
    assert {r["call"] for r in rows if r["kind"] == "backend"} == {"user", "persistent"}, "prepared: only on request"
    assert doc["settings"]["calls"] == ["user", "persistent"] and doc["settings"]["timing"] == "call"
    anchors = {(r["path"], *key(r)) for r in rows if r["kind"] == "anchor"}
    assert all(r["call"] is None for r in rows if r["kind"] == "anchor")
    for row in rows:
        if row["kind"] == "backend":  # no mpigpu backend without its anchor beside it
            assert (row["anchor"], *key(row)) in anchors
    # the side-by-side table: the user's call, the request and the anchors in one row per size
    side = done.stdout.split("# side by side [host arrays, int32 avg, in-place]")[1].splitlines()
    columns = side[1].split()[3:]
    assert {"cpu", "cpu:req", *names} <= set(columns)
    assert columns.index("cpu") < columns.index("cpu:req") < columns.index("mpi-host"), "calls, requests, anchors"
    assert [line.split()[2] for line in side[2:6]] == ["8", "16", "32", "64"]
    cpu_64 = next(r for r in by_path["cpu"] if r["call"] == "user" and key(r) == ("host", "int32", "avg", True, 64))
    assert side[5].split()[3 + columns.index("cpu")] == f"{cpu_64['median_us']:.2f}"


# -- plot and compare -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("bench2")
    extra = ["--plot", str(tmp / "run.png")] if has_matplotlib() else []
    done = ok(bench(2, tmp, "-e", "128", "--backends", "cpu", "--json", str(tmp / "run.json"), *extra))
    return tmp, done


def test_plot_writes_png(two_rank_run: tuple[Path, Any]) -> None:
    if not has_matplotlib():
        pytest.skip("matplotlib is not installed (pip install matplotlib)")
    tmp, _ = two_rank_run
    assert (tmp / "run.png").read_bytes()[:8] == PNG


def test_replot_from_json_alone(two_rank_run: tuple[Path, Any]) -> None:
    if not has_matplotlib():
        pytest.skip("matplotlib is not installed (pip install matplotlib)")
    tmp, _ = two_rank_run
    again = tmp / "again.png"
    command = [sys.executable, "-m", "mpigpu.bench", "--replot", str(tmp / "run.json"), "--plot", str(again)]
    ok(subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False))
    assert again.read_bytes()[:8] == PNG


def _compare(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mpigpu.bench", "--compare", str(a), str(b)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def test_compare_prints_ratios(two_rank_run: tuple[Path, Any]) -> None:
    tmp, _ = two_rank_run
    a = tmp / "run.json"
    doc = json.loads(a.read_text())
    for row in doc["results"]:  # B: every cpu call twice as slow, one mpi-host size missing
        if row["path"] == "cpu":
            row["median_us"] *= 2
    doc["results"] = [r for r in doc["results"] if not (r["path"] == "mpi-host" and r["bytes"] == 8)]
    b = tmp / "slower.json"
    b.write_text(json.dumps(doc))
    done = ok(_compare(a, b))
    rows = [line.split() for line in done.stdout.splitlines() if not line.startswith("#")]
    ratios = {(r[0], int(r[5])): float(r[8]) for r in rows}
    assert ratios[("cpu", 8)] == pytest.approx(2.0, abs=1e-3)
    assert ratios[("mpi-host", 16)] == pytest.approx(1.0, abs=1e-3)
    assert ("mpi-host", 8) not in ratios
    assert "cpu (host): B/A geometric mean 2.000" in done.stdout
    assert "2 only in A, 0 only in B" in done.stdout  # in place and out of place at 8 B


def test_compare_refuses_a_file_that_is_not_a_run(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"tables": {}}')
    done = ok(_compare(bad, bad), 2)
    assert "not a JSON file written by `mpigpu.bench --json`" in done.stderr


# -- tuning and auto ------------------------------------------------------------------------------
def test_tune_writes_a_table_that_auto_then_uses(tmp_path: Path) -> None:
    table = tmp_path / "tune.json"
    other = {"signature": {"gpu": "H9000"}, "bands": {"device": [[1024, "nccl"]]}}
    table.write_text(json.dumps({"tables": {"gpu=H9000": other}}))
    out = tmp_path / "tuned.json"
    done = ok(bench(2, tmp_path, "-e", "64", "--backends", "cpu", "--tune", "--json", str(out)))
    assert "# tuned crossover table for " in done.stdout and str(table) in done.stdout
    assert "# auto vs the fastest mpigpu backend called the same way (median): within 5% at" in done.stdout

    written = json.loads(table.read_text())["tables"]
    assert written["gpu=H9000"] == other, "other machines' tables are kept"
    doc = json.loads(out.read_text())
    mine = written[doc["tuning"]["key"]]
    assert mine["signature"] == doc["machine"]["signature"]
    assert mine["bands"] == {"host": [[64, "cpu"]]}
    assert doc["tuning"]["applies"] == str(table)
    assert doc["settings"]["calls"] == ["user", "persistent", "prepared"], "--tune compares prepared calls"
    autos = [r for r in doc["results"] if r["kind"] == "auto"]
    assert sorted(r["call"] for r in autos) == ["persistent"] * 8 + ["prepared"] * 8 + ["user"] * 8
    assert all(r["chosen"] == "cpu" and r["wrong"] == 0 for r in autos)
    assert all(r["chosen_reason"].startswith(f"tuned table ({table})") for r in autos)
    assert all(r["best"] == "cpu" and r["best_us"] > 0 for r in autos), "the fastest backend is re-timed beside auto"
    assert sorted(r["call"] for r in doc["rechecks"]) == sorted(r["call"] for r in autos), "re-timed called alike"
    assert all(r["wrong"] == 0 and r["path"] == "cpu" for r in doc["rechecks"])
    assert doc["auto"]["sizes"] == 24

    # a table naming other winners: auto follows it wherever that backend can run
    bands = {"host": [[16, "cpu"], [1 << 40, "host"]]}
    table.write_text(json.dumps({"tables": {doc["tuning"]["key"]: {"signature": mine["signature"], "bands": bands}}}))
    out2 = tmp_path / "crafted.json"
    ok(bench(2, tmp_path, "-e", "64", "--backends", "auto,cpu,host", "--out-of-place", "--json", str(out2)))
    doc2 = json.loads(out2.read_text())
    host_ok = not any(line.startswith("host:") for line in doc2["skipped"])
    lookup = TuningTable(mine["signature"], {"host": [(16, "cpu"), (1 << 40, "host")]}, str(table)).lookup
    autos = [r for r in doc2["results"] if r["kind"] == "auto"]
    assert [r["bytes"] for r in autos if r["call"] == "user"] == [8, 16, 32, 64]
    assert [r["bytes"] for r in autos if r["call"] == "persistent"] == [8, 16, 32, 64]
    for row in autos:
        if host_ok or lookup("host", row["bytes"]) == "cpu":
            assert row["chosen"] == lookup("host", row["bytes"]), row
            assert row["chosen_reason"].startswith("tuned table"), row
        else:
            assert row["chosen"] == "cpu" and row["chosen_reason"].startswith("rule"), row

    info = ok(run_mpi(2, ["-m", "mpigpu.info", "--json"], env={"MPIGPU_TUNE_FILE": str(table)}))
    assert json.loads(info.stdout)["tuning"]["applies"] == str(table)


def test_auto_without_a_table_uses_the_rules(tmp_path: Path) -> None:
    out = tmp_path / "auto.json"
    ok(bench(1, tmp_path, "-e", "16", "--backends", "auto", "--inplace", "--json", str(out)))
    autos = json.loads(out.read_text())["results"]
    assert [(r["path"], r["call"], r["bytes"]) for r in autos] == [
        ("auto", call, size) for size in (8, 16) for call in ("user", "persistent")
    ], "at each size, every path timed interleaved"
    assert all(r["chosen_reason"].startswith("rule") and r["chosen"] == "cpu" for r in autos)


# -- failures -----------------------------------------------------------------------------------
def test_a_wrong_element_makes_the_exit_status_1(tmp_path: Path) -> None:
    out = tmp_path / "bad.json"
    done = ok(bench(2, tmp_path, "-e", "16", "--backends", "cpu", "--corrupt", "2", "--json", str(out)), 1)
    assert "# FAIL: cpu (host) float32 sum out-of-place 8 B: 2 wrong elements" in done.stdout
    assert "# FAIL: " in done.stdout.splitlines()[-1]
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["failures"]
    assert all(r["wrong"] == 2 for r in doc["results"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-b", "1K", "-e", "8"], "larger than --max-bytes"),
        (["--backends", "mpi"], "unknown backend or anchor 'mpi'"),
        (["--dtypes", "complex64"], "unsupported dtype 'complex64'"),
        (["--ops", "mean"], "unknown op 'mean'"),
        (["--step-factor", "1"], "--step-factor must be >= 2"),
        (["--calls", "user,fast"], "unknown call 'fast'"),
        (["--timing", "events"], "invalid choice: 'events'"),
        (["--time-limit", "-1"], "not a number of seconds"),
        (["--backends", "nccl"], "nothing to time: nccl:"),
    ],
)
def test_bad_options_exit_2_with_one_message(tmp_path: Path, args: list[str], message: str) -> None:
    from conftest import gpu_available

    if gpu_available() and args == ["--backends", "nccl"]:
        pytest.skip("nccl can run here")
    done = ok(bench(2, tmp_path, *args), 2)
    assert message in done.stderr
    assert done.stderr.count("error:") == 1, "one message per job, not one per rank"


# -- the calls and the anchors ---------------------------------------------------------------------
def test_every_call_and_anchor_is_verified_before_it_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "calls.json"
    backends = "cpu,torch-gloo" if has_torch_gloo() else "cpu"
    done = ok(bench(2, tmp_path, "--sizes", "8,40", "--calls", "all", "--backends", backends, "--corrupt", "1",
                    "--json", str(out)), 1)  # fmt: skip
    doc = json.loads(out.read_text())
    columns = {"cpu", "cpu:req", "cpu:prep", "mpi-host", *(["torch-gloo"] if has_torch_gloo() else [])}
    assert {r["column"] for r in doc["results"]} == columns
    assert doc["settings"]["sizes"] == [8, 40]
    for column in columns:  # one damaged element on rank 0, seen in every row: each path's own result is checked
        rows = [r for r in doc["results"] if r["column"] == column]
        assert sorted((r["bytes"], r["inplace"]) for r in rows) == [(8, False), (8, True), (40, False), (40, True)]
        assert all(r["wrong"] == 1 for r in rows), column
    assert "# FAIL: cpu:req (host) float32 sum in-place 40 B: 1 wrong element" in done.stdout
    assert "#   prepared: diagnostic: mpigpu.calls.reduce.run of a call prepared once" in done.stdout


@pytest.mark.parametrize("n", [1, 2, 4])
def test_torch_gloo_anchor_and_torch_tensors_as_the_users_arrays(tmp_path: Path, n: int) -> None:
    if not has_torch_gloo():
        pytest.skip("torch with gloo is not installed")
    out = tmp_path / "torch.json"
    done = ok(bench(n, tmp_path, "-e", "32", "--backends", "cpu,torch-gloo", "--framework", "torch", "--dtypes",
                    "float32,int64", "--ops", "sum,avg,max", "--timing", "loop", "--json", str(out)))  # fmt: skip
    assert "torch.distributed.all_reduce, gloo backend, on torch CPU tensors" in done.stdout
    assert "# arrays passed to allreduce and allreduce_init: torch tensors" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["settings"]["framework"] == "torch" and doc["settings"]["timing"] == "loop"
    rows = doc["results"]
    assert all(r["wrong"] == 0 for r in rows)
    expected = {(d, o, m, s) for d in ("float32", "int64") for o in ("sum", "avg", "max") for m in (True, False)
                for s in (8, 16, 32)}  # fmt: skip
    for column in ("torch-gloo", "cpu", "cpu:req"):
        assert {(r["dtype"], r["op"], r["inplace"], r["bytes"]) for r in rows if r["column"] == column} == expected


def test_time_limit_stops_a_sweep_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "limited.json"
    done = ok(bench(1, tmp_path, "-e", "1K", "--backends", "cpu", "--out-of-place", "--time-limit", "1e-6",
                    "--json", str(out)))  # fmt: skip
    # the first size is never judged (its check carries one-time set-up such as kernel compilation);
    # the limit bounds a size, all its paths together
    assert "host float32 sum out-of-place (mpi-host, cpu, cpu:req): stopped after 16 B" in done.stdout
    doc = json.loads(out.read_text())
    assert {r["bytes"] for r in doc["results"]} == {8, 16}
    assert len(doc["stopped"]) == 1


def test_the_largest_size_is_timed_where_the_steps_miss_it(tmp_path: Path) -> None:
    out = tmp_path / "sizes.json"
    ok(bench(1, tmp_path, "-b", "8", "-e", "40", "-f", "4", "--backends", "cpu", "--inplace", "--json", str(out)))
    doc = json.loads(out.read_text())
    assert doc["settings"]["sizes"] == [8, 32, 40]
    for column in ("cpu", "cpu:req", "mpi-host"):
        assert [r["bytes"] for r in doc["results"] if r["column"] == column] == [8, 32, 40]


def test_benchmark_is_an_alias() -> None:
    command = [sys.executable, "-m", "mpigpu.benchmark", "--help"]
    done = ok(subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False))
    assert "--max-bytes" in done.stdout and "--tune" in done.stdout


# -- the crossover table (no MPI) -----------------------------------------------------------------
G = ("float32", "sum", False)


def _samples(times: dict[str, list[float]], sizes: list[int], group: tuple = G, placement: str = "host") -> list:
    return [Sample(placement, s, name, t, group) for name, ts in times.items() for s, t in zip(sizes, ts, strict=True)]


def test_bands_merge_winners_and_split_between_sizes() -> None:
    sizes = [1024, 2048, 4096, 8192]
    samples = _samples({"cpu": [1, 2, 9, 20], "host": [5, 5, 5, 5]}, sizes)
    assert bands_from_samples(samples) == {"host": [(int(math.sqrt(2048 * 4096)), "cpu"), (8192, "host")]}
    table = TuningTable({}, bands_from_samples(samples), "t")
    assert [table.lookup("host", s) for s in (8, 2048, 2900, 4096, 1 << 40)] == ["cpu", "cpu", "host", "host", "host"]
    assert describe_bands({"host": [(2896, "cpu"), (8192, "host")]}) == ["host: <= 2.8 KiB cpu | larger host"]


def test_near_ties_keep_the_previous_winner() -> None:
    sizes = [8, 16, 32]
    samples = _samples({"a": [1.0, 1.01, 1.0], "b": [2.0, 1.0, 2.0]}, sizes)
    assert best_per_size(samples) == {"host": [(8, "a"), (16, "a"), (32, "a")]}
    samples = _samples({"a": [1.0, 1.5, 1.0], "b": [2.0, 1.0, 2.0]}, sizes)
    assert best_per_size(samples) == {"host": [(8, "a"), (16, "b"), (32, "a")]}


def test_wrong_or_incomplete_backends_never_win() -> None:
    other = ("int32", "sum", True)
    samples = [
        Sample("device", 64, "fast-but-wrong", 1.0, G, ok=False),
        Sample("device", 64, "nccl", 3.0, G),
        Sample("device", 64, "half-measured", 2.0, G),  # missing in the second group
        Sample("device", 64, "nccl", 3.0, other),
        Sample("device", 64, "fast-but-wrong", 1.0, other),
    ]
    assert best_per_size(samples) == {"device": [(64, "nccl")]}


def test_groups_weigh_equally() -> None:
    other = ("float64", "sum", False)
    samples = _samples({"a": [1.0], "b": [1.1]}, [64]) + _samples({"a": [30.0], "b": [10.0]}, [64], other)
    assert best_per_size(samples) == {"host": [(64, "b")]}


def test_write_entry_keeps_other_machines_and_placements(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tune.json"
    me = {"gpu": "cpu", "ranks_per_node": 4}
    write_entry(path, me, {"device": [(100, "nccl")]}, {"created": "then"})
    path.write_text(json.dumps({"tables": {**json.loads(path.read_text())["tables"], "x": {"bands": {}}}}))
    entry = write_entry(path, me, {"host": [(64, "cpu"), (1 << 20, "host")]}, {"created": "now"})
    tables = json.loads(path.read_text())["tables"]
    assert set(tables) == {"x", signature_key(me)}
    assert entry == tables[signature_key(me)]
    assert entry["created"] == "now" and entry["signature"] == me
    assert entry["bands"] == {"device": [[100, "nccl"]], "host": [[64, "cpu"], [1 << 20, "host"]]}


def test_write_entry_refuses_to_overwrite_an_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "tune.json"
    path.write_text("{ not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        write_entry(path, {"gpu": "cpu"}, {"host": [(8, "cpu")]}, {})
    assert path.read_text() == "{ not json"
