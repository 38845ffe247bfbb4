"""Run by tests/nodes/test_faults_nodes.py under mpiexec at 2x2 (MPI nodes of MPICH's fork launcher):
one fault on the ranks of the last node after three good calls.

``kill DIR``: every rank of the last node writes the time to DIR/killed-<rank> and kills itself (SIGKILL).
``stall``: the last rank sleeps instead of making its fourth call.
``mismatch``: the last node's ranks pass another count, then one of its ranks an op it rejects; after each
failed call every rank makes one more call, whose sum shows that it paired. Each rank prints one line per
call: ``rank R call N: <outcome>``.
``gpus N,N,...``: a mis-launch on a machine without GPUs: rank r is made to see N[r] GPUs (GPU i's PCI bus
id is the same for every rank of a node, as on a real one), then makes its first call; prints
``rank R start-up: <outcome>``."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import mpigpu
from mpigpu.runtime.context import Context


def _line(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write: the ranks' lines do not interleave
    sys.stdout.flush()


def fake_gpus(counts: list[int]) -> None:
    """Rank r sees ``counts[r]`` GPUs (mpigpu.job.device's two looks at the hardware replaced)."""
    from mpi4py import MPI

    from mpigpu.job import device

    visible = counts[MPI.COMM_WORLD.Get_rank()]

    def describe(index: int, seen: int) -> device.GpuInfo:
        return device.GpuInfo(index, "stand-in GPU", f"00000000:{index + 1:02X}:00.0", "", (9, 0), seen, None)

    device.visible_device_count = lambda: visible  # type: ignore[assignment]
    device._describe = describe  # type: ignore[assignment]


def main(mode: str, rest: list[str]) -> None:
    if mode == "gpus":
        fake_gpus([int(n) for n in rest[0].split(",")])
        try:
            ctx = Context.get()
        except mpigpu.MpigpuError as exc:
            _line(f"rank {os.environ.get('PMI_RANK')} start-up: {type(exc).__name__}: {exc}".replace("\n", " | "))
            return
        _line(f"rank {ctx.rank} start-up: GPU {ctx.gpu.describe() if ctx.gpu else None}")
        return
    ctx = Context.get()
    layout = ctx.layout
    assert layout is not None and layout.num_nodes >= 2, "launch across MPI nodes"
    rank, size = ctx.rank, ctx.size
    last_node = layout.node_index == layout.num_nodes - 1
    x = np.ones(8, np.float32)
    for _ in range(3):
        mpigpu.allreduce(x, "sum")
    if mode == "kill" and last_node:
        Path(rest[0], f"killed-{rank}").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stall" and rank == size - 1:
        time.sleep(60)
    if mode == "mismatch":
        faults = [("count", np.ones(9 if last_node else 8, np.float32), "sum"),
                  ("op", np.ones(8, np.float32), "bogus" if rank == size - 1 else "sum")]  # fmt: skip
        for n, (what, arg, op) in enumerate(faults):
            try:
                mpigpu.allreduce(arg, op)
                _line(f"rank {rank} call {what}: no error")
            except mpigpu.MpigpuError as exc:
                _line(f"rank {rank} call {what}: {type(exc).__name__}: {exc}".replace("\n", " "))
            y = np.full(5, float(rank + 1 + n), np.float64)
            mpigpu.allreduce(y, "sum")
            _line(f"rank {rank} call after-{what}: {y[0]:g}")
        return
    mpigpu.allreduce(x, "sum")
    _line(f"rank {rank} done: {x[0]:g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
