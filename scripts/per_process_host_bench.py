"""Microseconds per allreduce call over several host devices per process: the Python cost of mpigpu.multi.

    python scripts/per_process_host_bench.py                   # 1 process x 2 host devices
    mpiexec -n 2 python scripts/per_process_host_bench.py      # 2 processes x 2 host devices

Two paths, float32 sum in place on NumPy arrays of --bytes (default 8): ``threads`` (a thread per device,
bound with mpigpu.on_device(k) for its life) and ``list`` (one thread, ``mpigpu.allreduce([x0, x1])``).
A round gives each path one turn, the first path alternating from round to round; a turn is --warmup
calls, then --iters calls back to back, timed from the first device's start to the last one's end (max
over ranks), and by the process's CPU time over the turn, warm-up included (every thread's; max over ranks: on a loaded
machine the steadier figure). A path's figures are the medians over rounds, in us per call. No GPU is
used: the figures are the call's Python and MPI cost, the part a GPU call adds to the data's movement.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="host devices per process (default 2)")
    parser.add_argument("--bytes", type=int, default=8, help="bytes per array (default 8: two float32)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=300, help="calls per turn")
    parser.add_argument("--warmup", type=int, default=30)
    return parser


class Threads:
    """One thread per device, each inside on_device(k) for its life, running the jobs it is handed."""

    def __init__(self, mpigpu: Any, arrays: list[np.ndarray]) -> None:
        self.mpigpu, self.arrays = mpigpu, arrays
        self.jobs: list[queue.Queue[Any]] = [queue.Queue() for _ in arrays]
        self.done: queue.Queue[Any] = queue.Queue()
        self.threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(len(arrays))]
        for thread in self.threads:
            thread.start()

    def _loop(self, k: int) -> None:
        with self.mpigpu.on_device(k):
            while (job := self.jobs[k].get()) is not None:
                self.done.put(job(k))

    def turn(self, warmup: int, iters: int) -> float:
        allreduce, arrays = self.mpigpu.allreduce, self.arrays

        def job(k: int) -> tuple[float, float]:
            x = arrays[k]
            for _ in range(warmup):
                allreduce(x, "sum")
            start = time.perf_counter()
            for _ in range(iters):
                allreduce(x, "sum")
            return start, time.perf_counter()

        for q in self.jobs:
            q.put(job)
        spans = [self.done.get() for _ in self.jobs]
        return max(end for _, end in spans) - min(start for start, _ in spans)

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for thread in self.threads:
            thread.join()


def _list_turn(mpigpu: Any, arrays: list[np.ndarray], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        mpigpu.allreduce(arrays, "sum")
    start = time.perf_counter()
    for _ in range(iters):
        mpigpu.allreduce(arrays, "sum")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ["MPIGPU_DEVICES_PER_RANK"] = str(args.devices)
    from mpi4py import MPI

    import mpigpu

    comm = MPI.COMM_WORLD
    arrays = [np.zeros(max(1, args.bytes // 4), np.float32) for _ in range(args.devices)]
    threads = Threads(mpigpu, arrays)
    paths: dict[str, Callable[[], float]] = {
        "threads": lambda: threads.turn(args.warmup, args.iters),
        "list": lambda: _list_turn(mpigpu, arrays, args.warmup, args.iters),
    }
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(args.rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            comm.Barrier()
            cpu = time.process_time()
            wall = paths[name]()
            wall, cpu = comm.allreduce(wall, op=MPI.MAX), comm.allreduce(time.process_time() - cpu, op=MPI.MAX)
            figures[name].append((wall, cpu))
    threads.close()
    if comm.Get_rank() == 0:
        print(f"# {comm.Get_size()} process(es) x {args.devices} host devices, {args.bytes} B, us per call")
        print("# load average: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
        print(f"{'path':8} {'wall':>9} {'cpu':>9}")
        for name, values in figures.items():
            wall = statistics.median(w for w, _ in values) / args.iters * 1e6
            cpu = statistics.median(c for _, c in values) / (args.warmup + args.iters) * 1e6  # warm-up included
            print(f"{name:8} {wall:9.1f} {cpu:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
