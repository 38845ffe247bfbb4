"""Time the ipc backend per call, eager and replayed from a CUDA graph, beside raw NCCL.

    mpirun -np 4 python3 scripts/ipc_latency.py [--json PATH]

Sizes 8 B .. 1 MiB (float32, sum). Each figure is the mean over 2000 calls after 200 warm-up calls,
timed with CUDA events on one stream, max over ranks. Every result is checked. Columns:
  ipc          a prepared call (no per-call argument check), launched from Python
  ipc-graph    one call captured in a CUDA graph, replayed from Python
  ipc-g100     100 calls captured in one graph: the GPU's time per all-reduce, free of launch cost
  nccl-raw     ncclAllReduce through cupy.cuda.nccl; nccl-g100: 100 of them in one graph
  api-ipc      mpigpu.allreduce(backend="ipc"): validation and the cross-rank check on every call
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from mpigpu.cli import require_gpu, write_json

require_gpu("scripts/ipc_latency.py")  # before CuPy is imported: exit 2 with what to install

import cupy as cp  # noqa: E402
from cupy.cuda import nccl  # noqa: E402

import mpigpu  # noqa: E402
from mpigpu.calls.ipc import ipc_graph  # noqa: E402
from mpigpu.core._mpi import MPI, world  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the table as JSON")
    args = parser.parse_args()
    comm = world()
    mpigpu.select_device(comm)
    stream = cp.cuda.Stream(non_blocking=True)
    uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None)
    raw = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())

    def timed(fn, iters: int = 2000) -> float:
        for _ in range(200):
            fn()
        stream.synchronize()
        comm.Barrier()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(iters):
            fn()
        end.record(stream)
        end.synchronize()
        return comm.allreduce(cp.cuda.get_elapsed_time(start, end) * 1e3 / iters, op=MPI().MAX)

    def graph_of(enqueue, copies: int = 100):
        """``copies`` back-to-back calls captured in one CUDA graph (stream capture)."""
        stream.begin_capture()
        for _ in range(copies):
            enqueue()
        return stream.end_capture()

    rows = []
    if comm.Get_rank() == 0:
        print(
            f"# {'bytes':>9} {'ipc':>8} {'ipc-graph':>10} {'ipc-g100':>9} {'nccl-raw':>9} {'nccl-g100':>10} "
            f"{'api-ipc':>8}   (us per all-reduce)"
        )
    for nbytes in (8, 1024, 16384, 65536, 262144, 1 << 20):
        count = max(1, nbytes // 4)
        x = cp.ones(count, cp.float32)
        out = cp.empty_like(x)
        prepared = mpigpu.calls.reduce.prepare(x, "sum", out=out, backend="ipc", stream=stream)
        eager = timed(lambda p=prepared: mpigpu.calls.reduce.run(p))
        api = timed(lambda x=x, out=out: mpigpu.allreduce(x, "sum", out=out, backend="ipc", stream=stream), 500)
        graph = ipc_graph(x, "sum", out=out, stream=stream)
        replay = timed(graph.launch)
        graph.close()
        ok = bool((out == comm.Get_size()).all())
        g100 = graph_of(lambda p=prepared: mpigpu.calls.reduce.run(p))
        ipc100 = timed(lambda g=g100: g.launch(stream), 40) / 100
        ok = ok and bool((out == comm.Get_size()).all())

        def nccl_call(x=x, out=out, c=count) -> None:
            raw.allReduce(x.data.ptr, out.data.ptr, c, 7, 0, stream.ptr)

        nccl_us = timed(nccl_call)
        n100 = graph_of(nccl_call)
        nccl100 = timed(lambda g=n100: g.launch(stream), 40) / 100
        ok = comm.allreduce(ok and bool((out == comm.Get_size()).all()), op=MPI().LAND)
        del g100, n100  # graphs hold the NCCL communicator's kernels: release them before it is destroyed
        rows.append({"bytes": nbytes, "ipc_us": eager, "ipc_graph_us": replay, "ipc_graph100_us": ipc100,
                     "nccl_raw_us": nccl_us, "nccl_graph100_us": nccl100, "ipc_api_us": api, "ok": ok})  # fmt: skip
        if comm.Get_rank() == 0:
            print(
                f"  {nbytes:>9} {eager:>8.2f} {replay:>10.2f} {ipc100:>9.2f} {nccl_us:>9.2f} {nccl100:>10.2f} "
                f"{api:>8.2f}{'' if ok else '  WRONG'}"
            )
    stream.synchronize()
    gc.collect()
    raw.destroy()
    if args.json and comm.Get_rank() == 0:
        write_json(args.json, {"ranks": comm.Get_size(), "rows": rows})
    mpigpu.finalize()
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
