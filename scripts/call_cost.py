"""Where the time of one ``mpigpu.allreduce`` call goes: the whole call, its variants, and its parts.

    mpiexec -n 2 python scripts/call_cost.py                          # NumPy, 8 B and 64 KiB
    mpirun -np 4 python scripts/call_cost.py --framework torch --sizes 8,65536,1048576 --json cost.json
    mpirun -np 4 python scripts/call_cost.py --framework cupy --backend nccl

Each figure is the median over ``--iters`` samples, max over ranks, in microseconds. Collective
rows: one call per sample, with a barrier before it and, for GPU arrays, a synchronisation of the
stream after it (inside the timed region: the harness cost is the same in every row). Local rows
(the parts that need no other rank) are timed in batches of 100 calls per sample.

Rows:
  allreduce            mpigpu.allreduce(x): what a user calls, repeated (its call record: the check and
                       the bound launch)
  allreduce, validated the same call with its record forgotten before each call (ctx.plan_cache
                       cleared): the first call with these arguments (validation, check, binding, backend)
  async+wait           allreduce_async(x).wait()
  prepared run         reduce.run(p) with p = reduce.prepare(...) made once (no validation, no check)
  request start+wait   req.start(); req.wait() with req = allreduce_init(x) made once
  request()            req(): start and wait in one
  check alone          the cross-rank signature check (calls.pipeline.check) of a prepared call, collective: through
                       node-shared memory where every rank is on one node (the check board), else MPI
  check via MPI        the same signature through MPI_Allreduce (a communicator without a board), for comparison
  backend alone        the chosen backend's allreduce(x, out, op, stream), collective
  call key + lookup    what a repeated call reads of its arguments, and the lookup of its record
  validate             the allreduce family's validate: everything local in a first call (the next rows are its parts)
  parse_op, as_view, Context.get, choose_cached, resolve_stream
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mpigpu
from mpigpu.backends import backend_code
from mpigpu.calls import reduce
from mpigpu.calls.keys import call_key
from mpigpu.calls.pipeline import check
from mpigpu.cli import require_gpu
from mpigpu.core._cuda import resolve_stream
from mpigpu.core._mpi import MPI, world
from mpigpu.core.arrays import as_view
from mpigpu.core.ops import parse_op
from mpigpu.job.check import Signature, check_signature
from mpigpu.runtime.context import Context
from mpigpu.runtime.plan import choose_cached

_BATCH = 100


def _array(framework: str, nbytes: int, dtype: str, rank: int) -> tuple[Any, Callable[[], None]]:
    """A ``nbytes`` array of small integers (sums stay exact) and the stream synchronisation to call after each call."""
    count = max(1, nbytes // np.dtype(dtype).itemsize)
    if framework == "numpy":
        return np.full(count, rank % 3, dtype), lambda: None
    if framework == "torch":
        import torch

        x = torch.full((count,), rank % 3, dtype=getattr(torch, dtype), device=f"cuda:{mpigpu.select_device().index}")
        return x, torch.cuda.current_stream().synchronize
    import cupy as cp

    cp.cuda.Device(mpigpu.select_device().index).use()
    return cp.full(count, rank % 3, dtype), cp.cuda.get_current_stream().synchronize


def _median_max(comm: Any, samples: list[float]) -> float:
    return float(comm.allreduce(statistics.median(samples) * 1e6, op=MPI().MAX))


def _collective(comm: Any, fn: Callable[[], Any], sync: Callable[[], None], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        comm.Barrier()
        t0 = clock()
        fn()
        sync()
        samples.append(clock() - t0)
    return _median_max(comm, samples)


def _local(comm: Any, fn: Callable[[], Any], iters: int) -> float:
    for _ in range(_BATCH):
        fn()
    samples = []
    clock = time.perf_counter
    for _ in range(max(10, iters // 10)):
        t0 = clock()
        for _ in range(_BATCH):
            fn()
        samples.append((clock() - t0) / _BATCH)
    return _median_max(comm, samples)


def profile(framework: str, nbytes: int, dtype: str, backend: str, iters: int, warmup: int) -> dict[str, Any]:
    """The rows for one size (collective)."""
    comm = world()
    x, sync = _array(framework, nbytes, dtype, comm.Get_rank())
    ctx = Context.get()
    prepared = reduce.prepare(x, "sum", backend=backend)
    req = mpigpu.allreduce_init(x, "sum", backend=backend)
    view, op = prepared.x, prepared.op
    engine = ctx.backend(prepared.choice.backend)
    plain = comm.Dup()  # no check board on it: check_signature takes the MPI path
    code = backend_code(prepared.choice.backend)
    signature = Signature(view.size, view.dtype.code, op.code, code, int(view.on_device), shape=view.shape)

    def start_wait() -> None:
        req.start()
        req.wait()

    def validated() -> None:
        ctx.plan_cache.clear()
        mpigpu.allreduce(x, "sum", backend=backend)

    rows: dict[str, float] = {}
    collective = {
        "allreduce": lambda: mpigpu.allreduce(x, "sum", backend=backend),
        "allreduce, validated": validated,
        "async+wait": lambda: mpigpu.allreduce_async(x, "sum", backend=backend).wait(),
        "prepared run": lambda: reduce.run(prepared),
        "request start+wait": start_wait,
        "request()": req,
        "check alone": lambda: check(ctx, prepared.record),
        "check via MPI": lambda: check_signature(plain, signature),
        "backend alone": lambda: engine.allreduce(view, prepared.out, op, prepared.stream),
    }
    for name, fn in collective.items():
        rows[name] = _collective(comm, fn, sync, iters, warmup)
    mpigpu.allreduce(x, "sum", backend=backend)  # its record, as the repeated call finds it
    local = {
        "call key + lookup": lambda: ctx.plan_cache.get(call_key(x, "sum", None, backend)),
        "validate": lambda: reduce.ALLREDUCE.validate(ctx, x, "sum", None, backend),
        "parse_op": lambda: parse_op("sum"),
        "as_view": lambda: as_view(x),
        "Context.get": Context.get,
        "choose_cached": lambda: choose_cached(ctx, view, op, backend),
    }
    if view.on_device:
        local["resolve_stream"] = lambda: resolve_stream(None, view.framework, view.device)
    for name, fn in local.items():
        rows[name] = _local(comm, fn, iters)
    req.free()
    plain.Free()
    return {"bytes": nbytes, "backend": prepared.choice.backend, "us": rows}


def _table(results: list[dict[str, Any]]) -> str:
    names = list(results[0]["us"])
    head = f"{'':<20}" + "".join(f"{str(r['bytes']) + ' B (' + r['backend'] + ')':>22}" for r in results)
    lines = [head]
    for name in names:
        lines.append(f"{name:<20}" + "".join(f"{r['us'].get(name, float('nan')):>22.2f}" for r in results))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{sys.executable} scripts/call_cost.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--framework", choices=("numpy", "torch", "cupy"), default="numpy")
    parser.add_argument("--sizes", default="8,65536", help="message sizes in bytes, comma-separated")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    if args.framework != "numpy":  # torch on CPU is not what this script measures: it times CUDA tensors
        require_gpu("scripts/call_cost.py", args.framework)
    comm = world()
    results = [
        profile(args.framework, int(size), args.dtype, args.backend, args.iters, args.warmup)
        for size in args.sizes.split(",")
    ]
    if comm.Get_rank() == 0:
        ctx = Context.get()
        print(
            f"# mpigpu call cost: {args.framework} {args.dtype}, op sum, {comm.Get_size()} ranks, "
            f"{ctx.mpi_lib.name}, MPIGPU_CHECK={int(ctx.settings.check)}, median of {args.iters}, max over ranks (us)"
        )
        print(_table(results))
        if args.json:
            document = {"framework": args.framework, "dtype": args.dtype, "ranks": comm.Get_size(), "results": results}
            with open(args.json, "w") as fh:
                json.dump(document, fh, indent=1)
    mpigpu.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
