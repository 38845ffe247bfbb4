"""Run by tests/multi/test_per_process_jobs.py under mpiexec: several host devices per process.

``bits LAYOUT``: LAYOUT lists the devices of each rank ("2", "1,1", "3,1", ...). Participant p (rank by
rank, device by device) holds the verifier's seed pattern for p of the job's participants, whose sums
round; each device reduces it with sum and avg (even ranks: a thread per device, odd ranks: one list
call). Rank 0 prints ``digest <dtype> <op> <participant> <sha256 of the result>`` for every device.

``two-comms``: two communicators, each used by a thread of its own with list calls, whose first calls
come in a different order on rank 0 than on the others. Prints ``ok <rank>``. A job that has not
finished within LIMIT_S prints every thread's stack and exits (a hang).

``steps OUTDIR ORDER``: a thread per device per step, one device failing in one step (see ``steps``)."""

from __future__ import annotations

import faulthandler
import hashlib
import os
import sys
import threading
import time

import numpy as np

LIMIT_S = 30.0
DTYPES = ("float32", "float64", "float16")
OPS = ("sum", "avg")
COUNT = 4099
STEPS = 4
STAGGER_S = 0.3
STEP_LIMIT_S = 10.0


def bits(layout: list[int]) -> None:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    assert MPI.COMM_WORLD.Get_size() == len(layout), layout
    os.environ["MPIGPU_DEVICES_PER_RANK"] = str(layout[rank])
    import mpigpu
    from mpigpu.core.ops import Op
    from mpigpu.core.patterns import fill

    n, total, first = layout[rank], sum(layout), sum(layout[:rank])
    assert mpigpu.local_devices() == list(range(n))

    def data(p: int, dtype: str, op: str) -> np.ndarray:
        x = np.empty(COUNT, dtype)
        fill(x, "seed", Op(op), p, total)
        return x

    lines = []
    for dtype in DTYPES:
        for op in OPS:
            xs = [data(first + k, dtype, op) for k in range(n)]
            outs = [np.full_like(x, np.nan) for x in xs]
            if rank % 2:
                mpigpu.allreduce(xs, op, out=outs)
            else:
                errors: list[BaseException] = []

                def device(k: int, xs=xs, outs=outs, op=op, errors=errors) -> None:
                    try:
                        with mpigpu.on_device(k):
                            mpigpu.allreduce(xs[k], op, out=outs[k])
                    except BaseException as exc:
                        errors.append(exc)

                threads = [threading.Thread(target=device, args=(k,)) for k in range(n)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                if errors:
                    raise errors[0]
            for k, out in enumerate(outs):
                lines.append(f"digest {dtype} {op} {first + k} {hashlib.sha256(out.tobytes()).hexdigest()}")
    gathered = MPI.COMM_WORLD.gather(lines, root=0)  # one writer: the ranks' lines would interleave
    if rank == 0:
        print("\n".join(line for part in gathered for line in part), flush=True)


def two_comms() -> None:
    from mpi4py import MPI

    os.environ["MPIGPU_DEVICES_PER_RANK"] = "2"
    import mpigpu

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comms = {"A": world.Dup(), "B": world.Dup()}
    for comm in comms.values():
        mpigpu.local_devices(comm)  # the contexts, created in the same order everywhere
    results: dict[str, object] = {}

    def work(name: str) -> None:
        try:
            results[name] = mpigpu.allreduce([np.ones(3), np.ones(3)], "sum", comm=comms[name])[0].tolist()
        except BaseException as exc:
            results[name] = exc

    order = ["A", "B"] if rank == 0 else ["B", "A"]
    threads = []
    for name in order:
        threads.append(threading.Thread(target=work, args=(name,)))
        threads[-1].start()
        time.sleep(0.5)
    for thread in threads:
        thread.join()
    want = [2.0 * size] * 3
    assert results == {"A": want, "B": want}, results
    print(f"ok {rank}", flush=True)


def steps(outdir: str, order: str) -> None:
    """The usage guide's pattern: each step starts a thread per device, each with its own ``on_device``
    block around its call; an exception leaves the block and is caught by the thread's function. In step 1
    rank 0's device 1 raises before its call. Each step starts the threads in ``order`` ("1,0": device 1's
    first, so the failed device's new block has begun before any call of the next step; "0,1": device 0's
    first, so its next-step call comes while device 1 is still marked failed), STAGGER_S apart. Each rank
    writes ``<step> <device> <result>`` lines to ``outdir/rank<r>.txt``."""
    from mpi4py import MPI

    os.environ["MPIGPU_DEVICES_PER_RANK"] = "2"
    import mpigpu

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    mpigpu.local_devices()
    total = 2 * size
    log = open(os.path.join(outdir, f"rank{rank}.txt"), "w", buffering=1)  # noqa: SIM115 - until exit

    def worker(step: int, k: int) -> None:
        try:
            with mpigpu.on_device(k):
                if step == 1 and rank == 0 and k == 1:
                    raise RuntimeError("device 1 gave up")
                x = np.full(5, 100.0 * step + 2 * rank + k)
                mpigpu.allreduce(x, "sum")
                want = 100.0 * step * total + sum(range(total))
                log.write(f"{step} {k} {'ok' if np.array_equal(x, np.full(5, want)) else x.tolist()}\n")
        except Exception as exc:
            log.write(f"{step} {k} {type(exc).__name__}\n")

    for step in range(STEPS):
        threads = [threading.Thread(target=worker, args=(step, int(k)), daemon=True) for k in order.split(",")]
        for thread in threads:
            thread.start()
            time.sleep(STAGGER_S)
        for thread in threads:
            thread.join(STEP_LIMIT_S)
        if any(thread.is_alive() for thread in threads):
            log.write(f"{step} stuck\n")
            log.close()
            os._exit(3)
    log.write("done\n")


def main() -> None:
    faulthandler.dump_traceback_later(LIMIT_S, exit=True)
    if sys.argv[1] == "bits":
        bits([int(n) for n in sys.argv[2].split(",")])
    elif sys.argv[1] == "steps":
        steps(sys.argv[2], sys.argv[3])
    else:
        two_comms()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
