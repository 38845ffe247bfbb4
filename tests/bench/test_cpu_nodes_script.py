"""scripts/cpu_nodes.py, the benchmark of allreduce across MPI nodes on CPUs: a small run at 2 ranks
on 2 MPI nodes (MPICH's fork launcher) writes the results file with its header and one checked row
per size, in microseconds, for auto, MPI and the cpu backend; a second run, in another layout, is
merged beside the first, and a rerun of a layout replaces its own rows only."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, load_script, run_mpi

SCRIPT = ROOT / "scripts" / "cpu_nodes.py"


def _run(path: Path, hosts: str | None, n: int, sizes: str) -> None:
    args = [str(SCRIPT), "--json", str(path), "--sizes", sizes, "--rounds", "2", "--scale", "0.01", "--backends", "cpu"]
    result = run_mpi(n, args, hosts=hosts, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_run_across_two_nodes_writes_checked_rows_and_a_second_layout_is_merged(tmp_path: Path) -> None:
    path = tmp_path / "cpu-nodes.json"
    _run(path, "nodeA:1,nodeB:1", 2, "8,4096")
    document = json.loads(path.read_text())
    assert {"machine", "mpi", "source", "versions", "date", "results"} <= set(document)
    assert document["source"] == load_script(ROOT / "scripts" / "source_digest.py").tree_digest(), "the code that ran"
    assert document["mpi"].startswith("MPICH"), document["mpi"]
    assert {"python", "mpigpu", "numpy", "mpi4py"} <= set(document["versions"])
    rows = document["results"]
    assert [(row["layout"], row["bytes"]) for row in rows] == [("2x1", 8), ("2x1", 4096)]
    for row in rows:
        assert row["ok"] and row["ranks"] == 2 and row["auto"] == "cpu", row  # one rank per node: cpu
        assert all(row[key] > 0 for key in ("auto_us", "mpi_us", "cpu_us")), row
        assert "host_us" not in row, "only the backends asked for"
    _run(path, None, 2, "8")  # one node of 2 ranks: merged beside the first layout's rows
    rows = json.loads(path.read_text())["results"]
    assert [(row["layout"], row["bytes"]) for row in rows] == [("1x2", 8), ("2x1", 8), ("2x1", 4096)]


def test_merge_replaces_a_layouts_rows_of_the_same_size_and_keeps_the_rest(tmp_path: Path) -> None:
    module = load_script(SCRIPT, "cpu_nodes_under_test")
    path = tmp_path / "r.json"
    old = [{"layout": "2x4", "bytes": 8, "auto_us": 9.0}, {"layout": "2x4", "bytes": 64, "auto_us": 7.0}]
    path.write_text(json.dumps({"machine": "old", "results": old}))
    header = {"machine": "new", "mpi": "MPICH", "versions": {}, "date": "today"}
    document = module.merge(path, header, [{"layout": "2x4", "bytes": 8, "auto_us": 3.0}])
    assert document["machine"] == "new"
    assert document["results"] == [{"layout": "2x4", "bytes": 8, "auto_us": 3.0}, old[1]]
    assert json.loads(path.read_text()) == document
    assert module.layout_label((4, 4)) == "2x4" and module.layout_label((2, 2, 2, 2)) == "4x2"
    assert module.layout_label((2, 1)) == "2+1" and module.layout_label((1,)) == "1x1"
