"""A short ipc workload for compute-sanitizer: every kernel path (one-shot and two-shot, staging
and direct, in place and out of place, aligned and unaligned, several dtypes, a graph replay) at
small sizes, each result verified. scripts/sanitize-ipc.sh runs it with every rank under the
sanitizer; it also runs on its own: mpirun -np 2 python3 scripts/ipc_sanitize_driver.py

Exit status: 0 when every result is right on every rank, 1 otherwise, 2 when ipc is unavailable.
"""

from __future__ import annotations

import sys


def main() -> int:
    from mpigpu.cli import require_gpu

    require_gpu("scripts/ipc_sanitize_driver.py")
    import cupy as cp

    import mpigpu
    from mpigpu.bench.harness import command_stream
    from mpigpu.bench.workload import POISON_BYTE, count_wrong_device, fill_device
    from mpigpu.calls.ipc import ipc_buffer, ipc_graph
    from mpigpu.core._mpi import world
    from mpigpu.core.dtypes import DTYPES
    from mpigpu.core.ops import Op
    from mpigpu.runtime.context import Context

    comm = world()
    mpigpu.select_device(comm)
    ctx = Context.get(comm)
    if not ctx.availability["ipc"].ok:
        if comm.Get_rank() == 0:
            print(f"ipc is not available: {ctx.availability['ipc'].reason}", flush=True)
        return 2
    backend = ctx.backend("ipc")
    rank, n = comm.Get_rank(), comm.Get_size()
    stream, ref = command_stream(ctx)
    failures: list[str] = []

    def check(x, out, count: int, dtype: str, op: Op, label: str) -> None:
        d = DTYPES[dtype]
        if out is not x:
            cp.cuda.runtime.memsetAsync(int(out.data.ptr), POISON_BYTE, count * d.itemsize, ref.handle)
        mpigpu.allreduce(x, op.value, out=None if out is x else out, backend="ipc", stream=stream)
        wrong = count_wrong_device(int(out.data.ptr), count, d, "exact", op, n, ctx.gpu, ref)
        if wrong:
            failures.append(f"{label}: {wrong} wrong")

    for algorithm, threshold in (("one-shot", None), ("two-shot", 0)):
        backend.two_shot_min_bytes = threshold
        for dtype in ("float32", "float16", "bfloat16", "float64", "int8"):
            d = DTYPES[dtype]
            for count in (1, 7, 4099, 70001):
                for op in (Op.SUM, Op.AVG):
                    for inplace in (True, False):
                        x = cp.empty(count, dtype=d.np)
                        fill_device(int(x.data.ptr), count, d, "exact", op, rank, n, ctx.gpu, ref)
                        out = x if inplace else cp.empty(count, dtype=d.np)
                        check(x, out, count, dtype, op, f"{algorithm} {dtype} {count} {op.value} inplace={inplace}")
        buf = ipc_buffer(4099 + 8, "float32")
        for start, length in ((0, 4099), (3, 1000)):
            view = buf[start : start + length]
            for inplace in (True, False):
                fill_device(int(view.data.ptr), length, DTYPES["float32"], "exact", Op.SUM, rank, n, ctx.gpu, ref)
                out = view if inplace else cp.empty(length, dtype=cp.float32)
                check(view, out, length, "float32", Op.SUM, f"{algorithm} ipc_buffer[{start}:] inplace={inplace}")

    backend.two_shot_min_bytes = None
    x, out = cp.empty(4099, dtype=cp.float32), cp.empty(4099, dtype=cp.float32)
    fill_device(int(x.data.ptr), 4099, DTYPES["float32"], "exact", Op.SUM, rank, n, ctx.gpu, ref)
    graph = ipc_graph(x, "sum", out=out, stream=stream)
    graph.launch()
    graph.close()
    if count_wrong_device(int(out.data.ptr), 4099, DTYPES["float32"], "exact", Op.SUM, n, ctx.gpu, ref):
        failures.append("graph replay")

    stream.synchronize()
    everywhere = comm.allgather(failures)
    mpigpu.finalize()
    if rank == 0:
        bad = [f"rank {r}: {f}" for r, fs in enumerate(everywhere) for f in fs]
        print("ipc sanitize driver: " + ("all results right" if not bad else "WRONG: " + "; ".join(bad)), flush=True)
    return 1 if any(everywhere) else 0


if __name__ == "__main__":
    sys.exit(main())
