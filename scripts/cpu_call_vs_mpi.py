"""The call a NumPy user writes beside the MPI call it replaces, on a machine with no GPU.

    mpiexec -n 2 python scripts/cpu_call_vs_mpi.py                        # 8 B, 64 KiB, 2 MiB, 8 MiB, 32 MiB
    mpiexec -n 2 python scripts/cpu_call_vs_mpi.py --sizes 8,65536 --op avg --json out.json

Columns, float32 in place, every one the same array of zeros (their sums stay exact):

  comm.Allreduce   ``comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)`` on mpi4py's world (avg: the sum and one
                   NumPy division, as a user writes it)
  MPI + NaN read   the same, then ``np.maximum.reduce(x)``: what the cpu backend's one read of a float
                   result for NaN costs on top of MPI (mpigpu.backends.cpu)
  allreduce(x)     ``mpigpu.allreduce(x, op)``: backend auto, the cross-rank check on (MPIGPU_CHECK)
  backend="cpu"    ``mpigpu.allreduce(x, op, backend="cpu")``
  backend="host"   ``mpigpu.allreduce(x, op, backend="host")`` (where auto's crossover between the two lies)

The columns are interleaved round by round (each round times every column, in turn, ``--iters``
calls), so a load that comes and goes on a shared machine falls on all of them alike. A sample is one
call between a barrier and the clock; each figure is the median over every round's samples on each
rank, then the slowest rank, in microseconds. Run it with ``PYTHONPATH`` pointing at another checkout
to compare two versions of mpigpu against the same MPI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mpigpu
from mpigpu.core._mpi import MPI, library_info, world

DEFAULT_SIZES = "8,65536,2097152,8388608,33554432"


def _columns(comm: Any, x: np.ndarray, op: str) -> dict[str, Callable[[], Any]]:
    mpi = MPI()
    n = np.float32(comm.Get_size())

    def mpi_call() -> None:
        comm.Allreduce(mpi.IN_PLACE, x, op=mpi.SUM)
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


def _iters(nbytes: int, scale: float) -> int:
    """Calls per column per round: about 20 ms of MPI time each on the 2-core machine."""
    per_call_us = 3 + nbytes / 4000  # ~4 GB/s: what MPICH's shared-memory allreduce gives there
    return max(5, int(scale * 20_000 / per_call_us))


def measure(comm: Any, nbytes: int, op: str, rounds: int, scale: float) -> dict[str, float]:
    """The median of every round's samples per column, slowest rank (collective)."""
    x = np.zeros(max(1, nbytes // 4), np.float32)
    columns = _columns(comm, x, op)
    iters = _iters(nbytes, scale)
    samples: dict[str, list[float]] = {name: [] for name in columns}
    clock = time.perf_counter
    for call in columns.values():  # warm up: backends made, records bound, pages touched
        for _ in range(3):
            call()
    for _ in range(rounds):
        for name, call in columns.items():
            mine = samples[name]
            for _ in range(iters):
                comm.Barrier()
                t0 = clock()
                call()
                mine.append(clock() - t0)
    return {name: float(comm.allreduce(statistics.median(s) * 1e6, op=MPI().MAX)) for name, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{sys.executable} scripts/cpu_call_vs_mpi.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes, comma-separated")
    parser.add_argument("--op", choices=("sum", "avg"), default="sum")
    parser.add_argument("--rounds", type=int, default=40, help="rounds of every column in turn")
    parser.add_argument("--scale", type=float, default=0.25, help="scale the calls per round (1: ~20 ms a column)")
    parser.add_argument("--json", help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    comm = world()
    load = os.getloadavg()[0]
    rows = {int(size): measure(comm, int(size), args.op, args.rounds, args.scale) for size in args.sizes.split(",")}
    if comm.Get_rank() == 0:
        where = mpigpu.__file__.rsplit("/mpigpu/", 1)[0]
        print(
            f"# float32 {args.op} in place, {comm.Get_size()} ranks, {library_info().name}, mpigpu from {where}, "
            f"{args.rounds} rounds interleaved, median us per call, slowest rank; load average "
            f"{load:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        names = list(next(iter(rows.values())))
        print(f"{'bytes':>10}" + "".join(f"{name:>17}" for name in names) + f"{'allreduce/MPI':>15}")
        for size, row in rows.items():
            ratio = row["allreduce(x)"] / row["comm.Allreduce"]
            print(f"{size:>10}" + "".join(f"{row[name]:>17.1f}" for name in names) + f"{ratio:>15.2f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"op": args.op, "ranks": comm.Get_size(), "mpigpu": where, "us": rows}, fh, indent=1)
    mpigpu.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
