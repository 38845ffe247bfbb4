"""The benchmark's columns timed interleaved (issue 31), in process under mpiexec -n 2 on the CPU
path: at each size every path takes its turn in every round, round r starting at path r mod k;
every rank plays the same turns in the same order; every path's result is verified; the JSON has
each round's figure. A recorder wraps the turns the sweep plays; no test here asserts a timing.
(The order alone, without MPI: ``test_rotation_...`` below runs serially.)"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from mpigpu.bench import main as bench
from mpigpu.bench import rounds, sweep

ROUNDS = 3
ARGS = ["--sizes", "8,4K", "--iters", "2", "--warmup", "1", "--rounds", str(ROUNDS), "--quiet", "--placement", "host"]
PATHS = {  # the paths of each run below, in the order of the header's '# paths' line
    "allreduce": ["mpi-host", "cpu", "cpu:req"],
    "allgather": ["mpi-host", "cpu", "cpu:out"],
}


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], list[str]]]:
    """Per size, as the sweep runs it: (the paths' columns as listed, the columns of the turns played)."""
    sizes: list[tuple[list[str], list[str]]] = []
    run_rounds, play = rounds.run_rounds, rounds.play

    def run_recorded(turns: list[rounds.Turn], count: int, **kwargs: Any) -> None:
        sizes.append(([t.path.column for t in turns], []))
        run_rounds(turns, count, **kwargs)

    def play_recorded(turn: rounds.Turn, **kwargs: Any) -> None:
        sizes[-1][1].append(turn.path.column)
        play(turn, **kwargs)

    monkeypatch.setattr(sweep, "run_rounds", run_recorded)
    monkeypatch.setattr(rounds, "play", play_recorded)
    return sizes


def _bench(comm: Any, tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """Run the benchmark collectively; (exit status, the JSON document) on every rank."""
    out = Path(comm.bcast(str(tmp_path), root=0)) / "run.json"
    argv = [*ARGS, "--json", str(out), *args]
    status = bench.run(bench.build_parser().parse_args(argv), ["test", *argv])
    assert len(set(comm.allgather(status))) == 1, "ranks disagree on the exit status"
    return status, comm.bcast(json.loads(out.read_text()) if comm.Get_rank() == 0 else None, root=0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", ["allreduce", "allgather"])
def test_paths_take_turns_in_rotated_rounds_on_every_rank(
    comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collective: str
) -> None:
    sizes = _record(monkeypatch)
    status, doc = _bench(comm, tmp_path, "--collective", collective, "--backends", "cpu")
    assert status == 0 and doc["ok"], doc["failures"]

    listed = PATHS[collective]
    modes = 2 if collective == "allreduce" else 1
    assert len(sizes) == 2 * modes, "one set of rounds per size and mode"
    for columns, played in sizes:
        assert columns == listed
        k = len(listed)
        expected = [column for r in range(ROUNDS) for column in (listed[r % k :] + listed[: r % k])]
        assert played == expected, "round r times every path once, starting at path r mod k"
        firsts = [played[r * k] for r in range(ROUNDS)]
        assert len(set(firsts)) == min(ROUNDS, k), "no path is always first"
    assert all(theirs == sizes for theirs in comm.allgather(sizes)), "every rank played the same turns"

    rows = doc["results"]
    assert sorted((r["column"], r["bytes"], r["inplace"]) for r in rows) == sorted(
        (c, b, m) for c in listed for b in (8, 4096) for m in ([False, True] if modes == 2 else [False])
    )
    for row in rows:
        assert row["wrong"] == 0 and row["ok"] is True
        assert row["rounds"] == row["repeats"] == ROUNDS and len(row["rounds_us"]) == ROUNDS
        assert row["median_us"] == pytest.approx(statistics.median(row["rounds_us"]))
        assert row["spread_us"] == pytest.approx(max(row["rounds_us"]) - min(row["rounds_us"]))
    assert doc["settings"]["rounds"] == ROUNDS
    assert any(line.startswith("# columns interleaved: ") for line in doc["header"])


@pytest.mark.mpi(min_size=2)
def test_each_path_is_verified_before_its_rounds(comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = _record(monkeypatch)
    status, doc = _bench(comm, tmp_path, "--backends", "cpu", "--inplace", "--corrupt", "1")
    assert status == 1 and not doc["ok"]
    assert {r["column"] for r in doc["results"]} == set(PATHS["allreduce"])
    assert all(r["wrong"] == 1 for r in doc["results"]), "one damaged element per check, seen in every path's row"
    assert [played for _, played in sizes] == [
        [c for r in range(ROUNDS) for c in PATHS["allreduce"][r:] + PATHS["allreduce"][:r]]
    ] * 2, "a wrong result is reported, and the path still timed in turn"


def test_rotation_starts_each_round_one_path_later() -> None:
    assert rounds.rotation(3, 0) == [0, 1, 2]
    assert rounds.rotation(3, 1) == [1, 2, 0]
    assert rounds.rotation(3, 4) == [1, 2, 0]
    assert rounds.rotation(1, 5) == [0]
    assert rounds.rotation(0, 2) == []


@pytest.mark.mpi(min_size=2)
def test_every_collective_of_one_run_takes_its_turns_in_rotated_rounds(
    comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: ``--collective all`` sweeps the five one after another in one job, each one's paths
    interleaved at each size as a run of one collective is; a JSON document per collective."""
    sizes = _record(monkeypatch)
    folder = Path(comm.bcast(str(tmp_path), root=0))
    argv = [*ARGS, "--collective", "all", "--backends", "cpu", "--inplace", "--json-dir", str(folder), "--tag", "t"]
    status = bench.run(bench.build_parser().parse_args(argv), ["test", *argv])
    assert set(comm.allgather(status)) == {0}
    assert all(theirs == sizes for theirs in comm.allgather(sizes)), "every rank played the same turns"
    order = ["allreduce", "reduce_scatter", "alltoall", "broadcast", "allgather"]
    extra = {"allreduce": ["cpu:req"], "alltoall": ["cpu:out"], "allgather": ["cpu:out"]}
    listed = {name: ["mpi-host", "cpu", *extra.get(name, [])] for name in order}
    assert [columns for columns, _ in sizes] == [listed[name] for name in order for _ in (8, 4096)]
    for columns, played in sizes:
        k = len(columns)
        assert played == [c for r in range(ROUNDS) for c in columns[r % k :] + columns[: r % k]]
    comm.Barrier()
    docs = {p.name: json.loads(p.read_text()) for p in folder.glob("t-*.json")}
    day = next(iter(docs.values()))["run"]["started"][:10]
    assert sorted(docs) == sorted(f"t-{name}-{day}.json" for name in order)
    for name in order:
        doc = docs[f"t-{name}-{day}.json"]
        assert doc["collective"] == name and doc["ok"] and doc["settings"]["rounds"] == ROUNDS
        assert {(r["column"], r["bytes"]) for r in doc["results"]} == {(c, b) for c in listed[name] for b in (8, 4096)}
        assert all(len(r["rounds_us"]) == ROUNDS for r in doc["results"])
