"""An integer average beside the sum of the same array on the cpu backend (issue 46: int8 avg was 20x
its sum): ``mpiexec -n 2 python scripts/int_avg_cost.py [--size 64M] [--rounds 5] [--dtype int8]``.

The two calls alternate round by round on the same data; each time is the slowest rank's, the figure
the median over rounds. The average is then checked exactly (truncated toward zero) against an int64
reference. One JSON line on rank 0."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import mpigpu
from mpigpu.cli import count_arg
from mpigpu.core._mpi import MPI, world


def _values(rank: int, size: int, dtype: str) -> np.ndarray:
    return (np.arange(size) % 251 - 125 + rank).astype(dtype)  # negative and positive, within int8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/int_avg_cost.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=count_arg, default=count_arg("64M"), help="elements (default 64M)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="int8", choices=["int8", "uint8", "int16", "uint16", "int32", "int64"])
    args = parser.parse_args(argv)
    comm = world()
    rank, n = comm.Get_rank(), comm.Get_size()
    x = _values(rank, args.size, args.dtype)
    times: dict[str, list[float]] = {"sum": [], "avg": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for op in ("sum", "avg"):
            y = x.copy()
            comm.Barrier()
            start = time.perf_counter()
            mpigpu.allreduce(y, op, backend="cpu")
            took = comm.allreduce(time.perf_counter() - start, op=MPI().MAX)
            if r:
                times[op].append(took * 1e3)
    total = sum(_values(k, args.size, args.dtype).astype(np.int64) for k in range(n))
    y = x.copy()
    mpigpu.allreduce(y, "avg", backend="cpu")
    exact = bool(np.array_equal(y.astype(np.int64), np.where(total < 0, -((-total) // n), total // n)))
    if rank == 0:
        sum_ms, avg_ms = (float(np.median(times[op])) for op in ("sum", "avg"))
        print(json.dumps({
            "ranks": n, "dtype": args.dtype, "bytes": x.nbytes, "rounds": args.rounds, "sum_ms": round(sum_ms, 1),
            "avg_ms": round(avg_ms, 1), "avg_over_sum": round(avg_ms / sum_ms, 2), "avg_exact": exact,
        }))  # fmt: skip
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
