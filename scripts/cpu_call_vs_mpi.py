"""The call a NumPy user writes beside the MPI call it replaces, on a machine with no GPU.

    mpiexec -n 2 python scripts/cpu_call_vs_mpi.py                        # allreduce: 8 B, 64 KiB, 2 MiB, 8 MiB, 32 MiB
    mpiexec -n 2 python scripts/cpu_call_vs_mpi.py --collective all --sizes 8,65536,2097152,8388608 --json cpu.json
    mpiexec -n 2 python scripts/cpu_call_vs_mpi.py --sizes 8,65536 --op avg --json out.json

Columns, float32, per collective (``--collective``: a comma-separated list or ``all``):

  allreduce (in place; the arrays stay zero, so the sums stay exact call after call)
    comm.Allreduce       ``comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)`` on mpi4py's world (avg: the sum and one
                         NumPy division, as a user writes it)
    MPI + NaN read       the same, then ``np.maximum.reduce(x)``: what the cpu backend's one read of a float
                         result for NaN costs on top of MPI (mpigpu.backends.cpu)
    allreduce(x)         ``mpigpu.allreduce(x, op)``: backend auto, the cross-rank check on (MPIGPU_CHECK)
    backend="cpu"        ``mpigpu.allreduce(x, op, backend="cpu")``
    backend="host"       ``mpigpu.allreduce(x, op, backend="host")`` (where auto's crossover between the two lies)
  reduce_scatter  ``comm.Reduce_scatter(x, o, shares, MPI.SUM)`` beside ``mpigpu.reduce_scatter(x, "sum", out=o)``
  alltoall        ``comm.Alltoallv`` into an output made once beside ``mpigpu.alltoall(x, out=o)`` into the
                  same output (splits given where the rows do not divide evenly; ``alltoall(x)``, a new array
                  each call, under an mpigpu whose alltoall takes no out=)
  broadcast       ``comm.Bcast(x, root=0)`` beside ``mpigpu.broadcast(x, root=0)``
  allgather       ``comm.Allgatherv`` into an output made once beside ``mpigpu.allgather(x, out=o)`` (likewise)
  (each of the four also with backend="cpu" and backend="host")

Each rank's rows are split as ``mpigpu.calls.reduce.scatter_rows(count, n)``. Before the rounds every
column is checked once on exact inputs (rank r's element j is ``(j + 3 r) % 8``: every result, a sum or
a copy, is compared with the one computed here; a wrong column makes the exit status 1).

The columns are interleaved round by round as the project's benchmarks are (``mpigpu.bench.rounds``:
round r times every column in turn, starting at column r mod k, ``--iters`` calls each), so a load
that comes and goes on a shared machine falls on all of them alike. A sample is one call between a
barrier and the clock; each figure is the median over every round's samples on each rank, then the
slowest rank, in microseconds. Run it with ``PYTHONPATH`` pointing at another checkout to compare two
versions of mpigpu against the same MPI.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mpigpu
from mpigpu.bench.rounds import rotation
from mpigpu.calls.reduce import scatter_rows
from mpigpu.core._mpi import MPI, library_info, world

DEFAULT_SIZES = "8,65536,2097152,8388608,33554432"
COLLECTIVES = ("allreduce", "reduce_scatter", "alltoall", "broadcast", "allgather")
MPI_COLUMN = {
    "allreduce": "comm.Allreduce",
    "reduce_scatter": "comm.Reduce_scatter",
    "alltoall": "comm.Alltoallv",
    "broadcast": "comm.Bcast",
    "allgather": "comm.Allgatherv",
}


def takes_out(name: str) -> bool:
    """Whether this mpigpu's ``name`` takes out= (an older checkout's allgather and alltoall do not)."""
    return "out" in inspect.signature(getattr(mpigpu, name)).parameters


USER_COLUMN = {
    "allreduce": "allreduce(x)",
    "reduce_scatter": 'reduce_scatter(x, "sum", out=o)',
    "alltoall": "alltoall(x, out=o)" if takes_out("alltoall") else "alltoall(x)",
    "broadcast": "broadcast(x, root=0)",
    "allgather": "allgather(x, out=o)" if takes_out("allgather") else "allgather(x)",
}


class Case:
    """One collective at one size on this rank: its arrays, its columns, and the check of each."""

    def __init__(self, comm: Any, collective: str, nbytes: int, op: str) -> None:
        self.comm, self.collective, self.op = comm, collective, op
        self.rank, self.n = comm.Get_rank(), comm.Get_size()
        self.count = max(1, nbytes // 4)
        self.rows = scatter_rows(self.count, self.n)
        self.x = np.zeros(self.count, np.float32)
        out = {"reduce_scatter": self.rows[self.rank], "alltoall": self.rows[self.rank] * self.n,
               "allgather": self.count * self.n}.get(collective, 0)  # fmt: skip
        self.o = np.zeros(out, np.float32)
        self.result: np.ndarray | None = None

    # -- the columns ----------------------------------------------------------------------------------
    def columns(self) -> dict[str, Callable[[], Any]]:
        if self.collective == "allreduce":
            return self._allreduce_columns()
        user = self._user_call()
        return {
            MPI_COLUMN[self.collective]: self._mpi_call(),
            USER_COLUMN[self.collective]: lambda: user(),
            'backend="cpu"': lambda: user(backend="cpu"),
            'backend="host"': lambda: user(backend="host"),
        }

    def _allreduce_columns(self) -> dict[str, Callable[[], Any]]:
        mpi, x, op = MPI(), self.x, self.op
        n = np.float32(self.n)

        def mpi_call() -> None:
            self.comm.Allreduce(mpi.IN_PLACE, x, op=mpi.SUM)
            if op == "avg":
                np.divide(x, n, out=x)

        def mpi_and_nan_read() -> None:
            mpi_call()
            np.maximum.reduce(x)

        return {
            "comm.Allreduce": mpi_call,
            "MPI + NaN read": mpi_and_nan_read,
            "allreduce(x)": lambda: mpigpu.allreduce(x, op),
            'backend="cpu"': lambda: mpigpu.allreduce(x, op, backend="cpu"),
            'backend="host"': lambda: mpigpu.allreduce(x, op, backend="host"),
        }

    def _mpi_call(self) -> Callable[[], Any]:
        mpi, comm, x, o, rows, n = MPI(), self.comm, self.x, self.o, self.rows, self.n
        float32 = mpi.FLOAT
        at = [sum(rows[:r]) for r in range(n)]
        share = rows[self.rank]
        if self.collective == "reduce_scatter":
            return lambda: comm.Reduce_scatter([x, float32], [o, float32], rows, mpi.SUM)
        if self.collective == "alltoall":
            send, recv = [x, (rows, at), float32], [o, ([share] * n, [r * share for r in range(n)]), float32]
            return lambda: comm.Alltoallv(send, recv)
        if self.collective == "broadcast":
            return lambda: comm.Bcast([x, float32], root=0)
        counts = [self.count] * n
        gathered = [o, (counts, [r * self.count for r in range(n)]), float32]
        return lambda: comm.Allgatherv([x, float32], gathered)

    def _user_call(self) -> Callable[..., Any]:
        x, o = self.x, self.o
        if self.collective == "reduce_scatter":
            return lambda **kw: mpigpu.reduce_scatter(x, "sum", out=o, **kw)
        if self.collective == "alltoall":
            splits = None if len(set(self.rows)) == 1 else self.rows  # even rows: none given, as a user calls it
            if takes_out("alltoall"):  # into the output made once, as torch's all_to_all_single
                return lambda **kw: mpigpu.alltoall(x, splits, out=o, **kw)
            return lambda **kw: mpigpu.alltoall(x, splits, **kw)
        if self.collective == "broadcast":
            return lambda **kw: mpigpu.broadcast(x, root=0, **kw)
        if takes_out("allgather"):  # as torch's all_gather_into_tensor
            return lambda **kw: mpigpu.allgather(x, out=o, **kw)
        return lambda **kw: mpigpu.allgather(x, **kw)

    # -- the check ------------------------------------------------------------------------------------
    def _input(self, rank: int) -> np.ndarray:
        return ((np.arange(self.count) + 3 * rank) % 8).astype(np.float32)

    def expected(self) -> np.ndarray:
        """This rank's exact result for the inputs ``_input`` gives every rank."""
        inputs = [self._input(r) for r in range(self.n)]
        at = sum(self.rows[: self.rank])
        share = self.rows[self.rank]
        if self.collective == "allreduce":
            total = np.sum(inputs, axis=0, dtype=np.float64)
            return (total / self.n if self.op == "avg" else total).astype(np.float32)
        if self.collective == "reduce_scatter":
            return np.sum(inputs, axis=0, dtype=np.float64)[at : at + share].astype(np.float32)
        if self.collective == "alltoall":
            return np.concatenate([row[at : at + share] for row in inputs])
        if self.collective == "broadcast":
            return inputs[0]
        return np.concatenate(inputs)

    def check(self, name: str, call: Callable[[], Any]) -> int:
        """Wrong elements of one call of ``call`` on exact inputs on this rank (the output poisoned
        first); the inputs are zero again after (the timed calls keep zeros: the sums stay exact)."""
        self.x[:] = self._input(self.rank)
        self.o[:] = np.nan
        returned = call()
        if self.collective in ("allreduce", "broadcast"):
            got = self.x
        elif self.collective == "reduce_scatter" or returned is None:
            got = self.o
        else:
            got = np.asarray(returned).reshape(-1)
        want = self.expected()
        wrong = want.size if got.shape != want.shape else int(np.count_nonzero(got != want))
        self.x[:] = 0
        return wrong


def _iters(nbytes: int, scale: float) -> int:
    """Calls per column per round: about 20 ms of MPI time each on the 2-core machine."""
    per_call_us = 3 + nbytes / 4000  # ~4 GB/s: what MPICH's shared-memory allreduce gives there
    return max(5, int(scale * 20_000 / per_call_us))


def measure(comm: Any, collective: str, nbytes: int, op: str, rounds: int, scale: float) -> dict[str, Any]:
    """The median of every round's samples per column, slowest rank, and each column's wrong
    elements summed over ranks (collective)."""
    case = Case(comm, collective, nbytes, op)
    return measure_columns(comm, case, case.columns(), rounds, scale)


def measure_columns(
    comm: Any, case: Case, columns: dict[str, Callable[[], Any]], rounds: int, scale: float
) -> dict[str, Any]:
    """``measure`` for the chosen ``columns`` of ``case`` (scripts/cpu_nodes.py takes a few)."""
    nbytes = case.count * 4
    names = list(columns)
    wrong = {name: int(comm.allreduce(case.check(name, call), op=MPI().SUM)) for name, call in columns.items()}
    iters = _iters(nbytes, scale)
    samples: dict[str, list[float]] = {name: [] for name in columns}
    clock = time.perf_counter
    for call in columns.values():  # warm up: backends made, records bound, pages touched
        for _ in range(3):
            call()
    for r in range(rounds):
        for i in rotation(len(names), r):  # round r starts at column r mod k
            name = names[i]
            call, mine = columns[name], samples[name]
            for _ in range(iters):
                comm.Barrier()
                t0 = clock()
                call()
                mine.append(clock() - t0)
    us = {name: float(comm.allreduce(statistics.median(s) * 1e6, op=MPI().MAX)) for name, s in samples.items()}
    return {"us": us, "wrong": wrong}


def _collectives(text: str) -> list[str]:
    names = list(COLLECTIVES) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in COLLECTIVES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown collective {unknown or text!r}: use {', '.join(COLLECTIVES)} or all")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{sys.executable} scripts/cpu_call_vs_mpi.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="message sizes in bytes (each rank's input), comma-separated"
    )
    parser.add_argument(
        "--collective", type=_collectives, default=["allreduce"], metavar="LIST",
        help=f"comma-separated, or all: {', '.join(COLLECTIVES)} (default allreduce)",
    )  # fmt: skip
    parser.add_argument("--op", choices=("sum", "avg"), default="sum", help="allreduce's op (the others sum or copy)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds of every column in turn")
    parser.add_argument("--scale", type=float, default=0.25, help="scale the calls per round (1: ~20 ms a column)")
    parser.add_argument("--json", help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    comm = world()
    load = os.getloadavg()[0]
    sizes = [int(size) for size in args.sizes.split(",")]
    found = {
        c: {size: measure(comm, c, size, args.op, args.rounds, args.scale) for size in sizes} for c in args.collective
    }
    bad = any(w for rows in found.values() for row in rows.values() for w in row["wrong"].values())
    if comm.Get_rank() == 0:
        where = mpigpu.__file__.rsplit("/mpigpu/", 1)[0]
        print(
            f"# float32, {comm.Get_size()} ranks, {library_info().name}, mpigpu from {where}, {args.rounds} rounds "
            f"interleaved (round r starting at column r mod k), median us per call, slowest rank; every column "
            f"checked on exact inputs first; load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        for collective, rows in found.items():
            names = list(next(iter(rows.values()))["us"])
            mpi_name, user = MPI_COLUMN[collective], USER_COLUMN[collective]
            mode = f" {args.op} in place" if collective == "allreduce" else ""
            print(f"# {collective}{mode}")
            width = max(17, *(len(name) + 2 for name in names))
            print(f"{'bytes':>10}" + "".join(f"{name:>{width}}" for name in names) + f"{'call/MPI':>10}")
            for size, row in rows.items():
                cells = "".join(
                    f"{'WRONG':>{width}}" if row["wrong"][name] else f"{row['us'][name]:>{width}.1f}" for name in names
                )
                print(f"{size:>10}{cells}{row['us'][user] / row['us'][mpi_name]:>10.2f}")
        if bad:
            print("# FAIL: a column gave a wrong result (WRONG above)")
        if args.json:
            document = {
                "op": args.op, "ranks": comm.Get_size(), "mpi": library_info().name, "mpigpu": where,
                "rounds": args.rounds, "order": "interleaved: round r starting at column r mod k",
                "ok": not bad, "collectives": found,
            }  # fmt: skip
            if args.collective == ["allreduce"]:
                document["us"] = {size: row["us"] for size, row in found["allreduce"].items()}  # the earlier form
            with open(args.json, "w") as fh:
                json.dump(document, fh, indent=1)
    mpigpu.finalize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
