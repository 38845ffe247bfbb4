"""allreduce across MPI nodes on CPUs: auto, each backend and comm.Allreduce, for the layout of one
mpiexec, merged into one JSON file of every layout (scripts/cpu-nodes.sh loops the layouts).

    mpiexec -launcher fork -hosts nodeA:4,nodeB:4 -n 8 python scripts/cpu_nodes.py --json out.json
    mpiexec -launcher fork -hosts nodeA:2,nodeB:1 -n 3 python scripts/cpu_nodes.py --json out.json --backends cpu

float32, sum, in place; the columns of scripts/cpu_call_vs_mpi.py (``comm.Allreduce(MPI.IN_PLACE, x)``,
``mpigpu.allreduce(x, "sum")`` with backend auto, then backend="cpu" and "host"), and up to 64 KiB the
same auto call on a communicator whose check board runs its Python path (``board_python_us``: the
compiled exchange's gain, mpigpu.job.native_board; absent where the compiled one is not here), each checked once on
exact inputs, then interleaved over ``--rounds`` rounds; each figure is the median of every round's
samples on each rank, then the slowest rank, in microseconds. The file holds

    {"machine": ..., "mpi": ..., "source": ..., "versions": {...}, "date": ..., "results": [
        {"layout": "2x4", "bytes": 8, "auto_us": ..., "mpi_us": ..., "cpu_us": ..., "host_us": ...,
         "board_python_us": ..., "board": "compiled", "auto": "cpu", "ranks": 8, "ok": true}, ...]}

with one row per (layout, bytes): a run replaces the rows of its own layout and sizes and keeps the
rest. "source" names the code that ran (scripts/source_digest.py: ``--find`` gives its commits). The
layout is nodes x ranks per node ("2x4"), or each node's ranks ("2+1") where they differ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, when imported by a test

import cpu_call_vs_mpi as calls
import source_digest

import mpigpu
from mpigpu.core._mpi import MPI, library_info, world
from mpigpu.runtime.context import Context

DEFAULT_SIZES = "8,65536,1048576,8388608"
PYTHON_BOARD_BYTES = 65536  # the Python board's column up to this size (beyond it the check is a small part)
BACKENDS = ("cpu", "host")
# the row's keys for cpu_call_vs_mpi's allreduce columns
PYTHON_BOARD = "allreduce(x), Python board"
KEYS = {"comm.Allreduce": "mpi_us", "allreduce(x)": "auto_us", 'backend="cpu"': "cpu_us", 'backend="host"': "host_us",
        PYTHON_BOARD: "board_python_us"}  # fmt: skip


def _python_board_comm(comm: Any) -> Any:
    """A duplicate of ``comm`` whose mpigpu context (made now, collective) has its check board on the
    Python path (MPIGPU_BOARD_HANDLER=python while it is made)."""
    dup = comm.Dup()
    before = os.environ.get("MPIGPU_BOARD_HANDLER")
    os.environ["MPIGPU_BOARD_HANDLER"] = "python"
    try:
        board = Context.get(dup).check_board
    finally:
        if before is None:
            del os.environ["MPIGPU_BOARD_HANDLER"]
        else:
            os.environ["MPIGPU_BOARD_HANDLER"] = before
    assert board is None or board.native is None
    return dup


def layout_label(node_sizes: tuple[int, ...]) -> str:
    """ "2x4" (nodes x ranks per node), or "2+1" where the nodes hold different numbers of ranks."""
    if len(set(node_sizes)) == 1:
        return f"{len(node_sizes)}x{node_sizes[0]}"
    return "+".join(map(str, node_sizes))


def versions() -> dict[str, str]:
    import mpi4py

    return {"python": platform.python_version(), "mpigpu": mpigpu.__version__, "numpy": np.__version__,
            "mpi4py": mpi4py.__version__}  # fmt: skip


def merge(path: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The document at ``path`` with ``rows`` in place of its rows of the same (layout, bytes), and the
    header (machine, MPI, versions, date) of this run; written back (a new file where none is)."""
    document: dict[str, Any] = {"results": []}
    if path.exists():
        document = json.loads(path.read_text())
        if not isinstance(document, dict) or not isinstance(document.get("results"), list):
            raise SystemExit(f"{path}: not a results file of this script (no 'results' list)")
    fresh = {(row["layout"], row["bytes"]) for row in rows}
    kept = [row for row in document["results"] if (row.get("layout"), row.get("bytes")) not in fresh]
    document.update(header)
    document["results"] = sorted(kept + rows, key=lambda row: (row["layout"], row["bytes"]))
    path.write_text(json.dumps(document, indent=1) + "\n")
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{sys.executable} scripts/cpu_nodes.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes, comma-separated")
    parser.add_argument("--backends", default="cpu,host", help="backend columns beside auto and MPI (cpu,host)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of every column in turn")
    parser.add_argument("--scale", type=float, default=0.25, help="scale the calls per round (1: ~20 ms a column)")
    parser.add_argument("--machine", default=platform.node(), help="the machine's name in the file")
    parser.add_argument("--json", required=True, help="the results file to write or merge into")
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if any(b not in BACKENDS for b in backends):
        parser.error(f"--backends: choose among {', '.join(BACKENDS)}")
    comm = world()
    ctx = Context.get(comm)
    layout = layout_label(ctx.layout.node_sizes)
    compiled = ctx.check_board is not None and ctx.check_board.native is not None
    python_board = _python_board_comm(comm) if compiled else None
    rows = []
    for nbytes in (int(size) for size in args.sizes.split(",")):
        case = calls.Case(comm, "allreduce", nbytes, "sum")
        columns = {name: call for name, call in case.columns().items() if name in KEYS}
        for backend in BACKENDS:
            if backend not in backends:
                del columns[f'backend="{backend}"']
        if python_board is not None and nbytes <= PYTHON_BOARD_BYTES:
            columns[PYTHON_BOARD] = lambda x=case.x: mpigpu.allreduce(x, "sum", comm=python_board)
        found = calls.measure_columns(comm, case, columns, args.rounds, args.scale)
        row: dict[str, Any] = {"layout": layout, "bytes": nbytes, "ranks": comm.Get_size()}
        row.update({KEYS[name]: round(us, 2) for name, us in found["us"].items()})
        row["board"] = "compiled" if compiled else "python"
        row["auto"] = mpigpu.explain(case.x, "sum").backend
        row["ok"] = not any(found["wrong"].values())
        rows.append(row)
    if comm.Get_rank() == 0:
        mpi_version = MPI().Get_library_version().splitlines()[0].strip()
        header = {"machine": args.machine, "cores": os.cpu_count(), "mpi": library_info().name,
                  "source": source_digest.tree_digest(),
                  "mpi_version": mpi_version, "versions": versions(),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "method": f"float32 sum in place, {args.rounds} rounds interleaved, median per rank, slowest rank",
                  "load": round(os.getloadavg()[0], 1)}  # fmt: skip
        merge(Path(args.json), header, rows)
        for row in rows:
            print(json.dumps(row))
    ok = all(row["ok"] for row in rows)
    MPI().COMM_WORLD.Barrier()
    mpigpu.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
