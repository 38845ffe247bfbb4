"""The tuning table is read and validated on rank 0 and its verdict broadcast, so every rank uses the
same table or none; a table that cannot be used is ignored with one warning, never an exception on
some ranks only (issue 12, section 2). It is trusted only if only this user can have written it, and
it is written atomically without following a planted link (section 1).

The ``mpi`` tests run under ``mpiexec -n 1, 2, 3 and 4``; the serial ones start their own 2-rank job, so a
hang on the unfixed code fails by timeout instead of stalling the suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import run_mpi

from mpigpu.core.errors import ConfigError
from mpigpu.runtime.tuning import TuningTable, load_tuning, machine_signature, signature_key, write_entry

WARNING = "mpigpu: ignoring the tuning table"
OTHER_UID = 54321
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid (os.chown)")


def _table(key: str, signature: dict[str, Any], bands: Any) -> str:
    return json.dumps({"tables": {key: {"signature": signature, "bands": bands}}})


def _good(key: str, signature: dict[str, Any]) -> str:
    return _table(key, signature, {"host": [[64, "cpu"], [1 << 40, "host"]]})


def _chmod(mode: int) -> Callable[[Path], None]:
    return lambda path: os.chmod(path, mode)


def _give_away(path: Path) -> None:
    os.chown(path, OTHER_UID, OTHER_UID)


def _as_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)  # opening it for reading would wait for a writer


def _as_symlink(path: Path) -> None:
    target = path.with_name("real-table.json")  # a table of ours, but reached through a link
    path.rename(target)
    path.symlink_to(target)


# (content for this machine's key, what is done to the file afterwards)
BAD_TABLES = {
    "a-list": (lambda key, sig: "[]", None),
    "tables-is-a-list": (lambda key, sig: '{"tables": []}', None),
    "not-json": (lambda key, sig: "{ not json", None),
    "band-edge-not-an-integer": (lambda key, sig: _table(key, sig, {"host": [["big", "cpu"]]}), None),
    "band-edge-a-float": (lambda key, sig: _table(key, sig, {"host": [[64.5, "cpu"]]}), None),
    "band-not-a-pair": (lambda key, sig: _table(key, sig, {"host": [[64]]}), None),
    "bands-a-list": (lambda key, sig: _table(key, sig, [[64, "cpu"]]), None),
    "edges-descending": (lambda key, sig: _table(key, sig, {"host": [[128, "cpu"], [64, "host"]]}), None),
    "unknown-backend": (lambda key, sig: _table(key, sig, {"host": [[64, "gloo"]]}), None),
    "unknown-placement": (lambda key, sig: _table(key, sig, {"gpu": [[64, "nccl"]]}), None),
    "bad-entry-of-another-machine": (
        lambda key, sig: json.dumps({"tables": {key: {"signature": sig, "bands": {}}, "other": []}}),
        None,
    ),
    "world-writable": (_good, _chmod(0o666)),
    "group-writable": (_good, _chmod(0o664)),
    "a-symlink": (_good, _as_symlink),
    "a-fifo": (_good, _as_fifo),
    "owned-by-another-uid": (_good, _give_away),
}


def _context_reading(comm: Any, path: Path) -> Any:
    """The world's context, but reading the table at ``path``."""
    from mpigpu.runtime.context import Context

    ctx = Context.get(comm)
    fields = ("rank", "comm", "gpu", "availability", "layout", "mpi_lib")
    return SimpleNamespace(
        settings=dataclasses.replace(ctx.settings, tune_file=path), **{f: getattr(ctx, f) for f in fields}
    )


def _shared_tmp(comm: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tune") if comm.Get_rank() == 0 else None
    return Path(comm.bcast(str(path) if path else None, root=0))


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_a_bad_table_is_ignored_with_one_warning_on_every_rank(
    comm: Any, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    if case == "owned-by-another-uid" and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another uid (os.chown)")
    path = _shared_tmp(comm, tmp_path_factory) / "tune.json"
    ctx = _context_reading(comm, path)
    if comm.Get_rank() == 0:
        signature = machine_signature(ctx)
        content, spoil = BAD_TABLES[case]
        path.write_text(content(signature_key(signature), signature))
        os.chmod(path, 0o644)
        if spoil is not None:
            spoil(path)
    comm.Barrier()
    capsys.readouterr()
    table = load_tuning(ctx)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith(WARNING)]
    every = comm.allgather((table, len(warnings)))
    assert [t for t, _ in every] == [None] * comm.Get_size()
    assert [n for _, n in every] == [1] + [0] * (comm.Get_size() - 1), every
    if comm.Get_rank() == 0:
        assert str(path) in warnings[0] and "built-in rules" in warnings[0]


@pytest.mark.mpi
def test_control_a_good_table_is_used_on_every_rank(
    comm: Any, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _shared_tmp(comm, tmp_path_factory) / "tune.json"
    ctx = _context_reading(comm, path)
    if comm.Get_rank() == 0:
        signature = machine_signature(ctx)
        path.write_text(_good(signature_key(signature), signature))
        os.chmod(path, 0o644)
    comm.Barrier()
    capsys.readouterr()
    table = load_tuning(ctx)
    assert WARNING not in capsys.readouterr().err
    expected = TuningTable(machine_signature(ctx), {"host": [(64, "cpu"), (1 << 40, "host")]}, str(path))
    assert comm.allgather(table) == [expected] * comm.Get_size()


# -- a real job, started here: the unfixed code hangs or aborts ------------------------------------------
JOB = """
import json, os, sys
import numpy as np
from mpi4py import MPI
import mpigpu
from mpigpu.core._mpi import library_info

path, case = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
if comm.Get_rank() == 0:
    sig = {"gpu": "cpu", "ranks_per_node": comm.Get_size(), "nodes": 1, "link": "none", "mpi": library_info().name}
    key = "|".join(f"{k}={sig[k]}" for k in sorted(sig))
    bad = {"tables": {key: {"signature": sig, "bands": {"host": [["big", "cpu"]]}}}}
    content = "[]" if case == "a-list" else json.dumps(bad)
    with open(path, "w") as f:
        f.write(content)
comm.Barrier()
x = np.full(8, comm.Get_rank() + 1.0)
mpigpu.allreduce(x, "sum")
sys.stdout.write(f"rank {comm.Get_rank()} sum {x[0]:g}\\n")
"""


@pytest.mark.parametrize("case", ["a-list", "band-edge-not-an-integer"])
def test_a_job_with_a_bad_table_runs_with_one_warning(tmp_path: Path, case: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    table = str(tmp_path / "tune.json")
    done = run_mpi(2, [str(script), table, case], timeout=60, env={"MPIGPU_TUNE_FILE": table, "MPIGPU_LOG": "0"})
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:2]) == ["rank 0 sum 3", "rank 1 sum 3"], done.stdout
    warnings = [line for line in done.stderr.splitlines() if WARNING in line]
    assert len(warnings) == 1, done.stderr


# -- writing -------------------------------------------------------------------------------------------
def test_write_entry_does_not_follow_a_link_at_the_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tune.json"
    victim = tmp_path / "victim.txt"
    victim.write_text("a file of the victim's")
    # the temporary names an attacker would plant: the old predictable one, and the new one made predictable
    (tmp_path / f".tune.json.tmp{os.getpid()}").symlink_to(victim)
    (tmp_path / "planted-temp").symlink_to(victim)
    monkeypatch.setattr("mpigpu.core.privatefs._temp_name", lambda name: "planted-temp", raising=False)
    with pytest.raises(ConfigError, match="cannot write the tuning table"):
        write_entry(path, {"gpu": "cpu"}, {"host": [(8, "cpu")]}, {})
    assert victim.read_text() == "a file of the victim's"
    assert not path.exists() and not path.is_symlink()


def test_write_entry_writes_a_file_only_its_owner_can_change(tmp_path: Path) -> None:
    path = tmp_path / "new" / "tune.json"
    write_entry(path, {"gpu": "cpu"}, {"host": [(8, "cpu")]}, {})
    assert path.stat().st_mode & 0o022 == 0 and not path.is_symlink()
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["tune.json"]  # no temporary file left


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(_give_away, marks=needs_root, id="owned-by-another-uid"),
        pytest.param(_chmod(0o666), id="world-writable"),
    ],
)
def test_write_entry_does_not_merge_a_table_another_user_could_have_written(
    tmp_path: Path, spoil: Callable[[Path], None]
) -> None:
    path = tmp_path / "tune.json"
    planted = json.dumps({"tables": {"x": {"signature": {}, "bands": {"host": [[8, "cpu"]]}}}})
    path.write_text(planted)
    spoil(path)
    with pytest.raises(ConfigError, match=r"not used.*MPIGPU_TUNE_FILE"):
        write_entry(path, {"gpu": "cpu"}, {"host": [(8, "cpu")]}, {})
    assert path.read_text() == planted
