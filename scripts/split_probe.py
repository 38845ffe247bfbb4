"""MPI_Allreduce against MPI_Reduce_scatter + MPI_Allgatherv on this launch's layout: the measurement behind
the cpu path's split route (mpigpu.backends.cpu.splits). Plain mpi4py and NumPy, no mpigpu call, so it
shows what the MPI library itself does on these nodes.

    mpiexec -launcher fork -hosts nodeA:4,nodeB:4 -n 8 python scripts/split_probe.py
    mpiexec -n 8 python scripts/split_probe.py --sizes 64K,1M     # one node, for comparison

Float32 sum; per size and path the slowest rank's median, us per call, the paths interleaved round by
round, each round from the same input:

    ar       comm.Allreduce(IN_PLACE, x, SUM)
    ar+read  the same, then the NaN read of the whole result (np.maximum.reduce), as the cpu path's
    rs+ag    comm.Reduce_scatter into this rank's block, the NaN read of the block, comm.Allgatherv

and whether rs+ag gave the same bits on every rank. Where rs+ag / ar+read is below 1 on a cluster's
layouts and sizes, the split route pays there; SPLIT_FROM and ``splits`` say where mpigpu takes it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

UNITS = {"K": 1 << 10, "M": 1 << 20}


def nbytes(text: str) -> int:
    """'64K', '8M' or a plain byte count."""
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64K,256K,1M,8M", help="bytes per rank, comma-separated (64K, 8M)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per size (default: 200 to 12 by size)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    nodes = comm.Split_type(MPI.COMM_TYPE_SHARED)
    layout = comm.allgather(nodes.Get_size() if nodes.Get_rank() == 0 else 0)
    nodes.Free()
    if rank == 0:
        per_node = "+".join(str(n) for n in layout if n)
        print(f"# {size} ranks, nodes {per_node}; {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'bytes':>9} {'ar':>9} {'ar+read':>9} {'rs+ag':>9}  rs+ag/ar+read  same bits")
    rng = np.random.default_rng(rank)
    for total in (nbytes(s) for s in args.sizes.split(",")):
        rounds = args.rounds or (200 if total <= 256 << 10 else 60 if total <= 1 << 20 else 12)
        us, same = measure(comm, rng.standard_normal(total // 4).astype(np.float32), rounds)
        if rank == 0:
            ratio = us["rs+ag"] / us["ar+read"]
            print(f"{total:>9} {us['ar']:9.1f} {us['ar+read']:9.1f} {us['rs+ag']:9.1f}  {ratio:13.2f}  {same}")


def measure(comm: MPI.Comm, source: np.ndarray, rounds: int) -> tuple[dict[str, float], bool]:
    """Each path's slowest-rank median (us) over ``rounds`` interleaved rounds from ``source``, and whether
    rs+ag gave every rank the same bits."""
    rank, size = comm.Get_rank(), comm.Get_size()
    base, extra = divmod(source.size, size)
    counts = [base + (r < extra) for r in range(size)]
    offsets = [base * r + min(r, extra) for r in range(size)]
    block = np.empty(counts[rank], np.float32)
    x = source.copy()

    def allreduce() -> None:
        comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)

    def allreduce_read() -> None:
        comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
        np.maximum.reduce(x)

    def split() -> None:
        comm.Reduce_scatter(x, block, counts, MPI.SUM)
        np.maximum.reduce(block)
        comm.Allgatherv(block, [x, counts, offsets, MPI.FLOAT])

    split()
    same = len(set(comm.allgather(x.tobytes()))) == 1
    paths = {"ar": allreduce, "ar+read": allreduce_read, "rs+ag": split}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, path in paths.items():
            x[...] = source
            comm.Barrier()
            start = time.perf_counter()
            path()
            times[name].append(time.perf_counter() - start)
    return {name: comm.allreduce(float(np.median(t)) * 1e6, MPI.MAX) for name, t in times.items()}, same


if __name__ == "__main__":
    main()
