"""A communicator per thread, the pattern mpigpu's one-thread error recommends: threads that start
(and free) mpigpu's contexts at the same time must never hang, and every result is exact.

Each test starts its own mpiexec, which runs ROUNDS rounds; in each, THREADS threads each call
``allreduce(x, "sum", comm=c, backend="host")`` on their own ``MPI.COMM_WORLD.Dup()``, then free it
(closing its context, collectively). A round that has not finished within ROUND_LIMIT_S prints
every thread's stack and ends the job. Before the fix, 5 of 10 one-round jobs hung (8 threads, 2
ranks): mpi4py's pickle-based ``comm.allreduce`` held the GIL while waiting, and contexts were
created and freed in a different order on each rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import run_mpi

THREADS = 8
ROUNDS = 20
ROUND_LIMIT_S = 20  # a healthy round takes well under a second

SCRIPT = """
import faulthandler, sys, threading
import numpy as np
from mpi4py import MPI
import mpigpu

threads, rounds, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
for round_ in range(rounds):
    faulthandler.dump_traceback_later(limit, exit=True)  # a hang: every thread's stack, then the end
    comms = [world.Dup() for _ in range(threads)]  # in the same order on every rank
    results = [np.full(5, np.nan) for _ in range(threads)]

    def work(i):
        x = np.arange(5, dtype=np.float64) + 1000.0 * rank + i  # exact sums
        results[i][...] = mpigpu.allreduce(x, "sum", comm=comms[i], backend="host")
        comms[i].Free()  # closes mpigpu's context of it (collective)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for i, got in enumerate(results):
        want = size * (np.arange(5, dtype=np.float64) + i) + 1000.0 * sum(range(size))
        assert np.array_equal(got, want), (round_, i, got, want)
    faulthandler.cancel_dump_traceback_later()
# the last round's contexts stay open: finalize (at exit) closes them, in the same order everywhere
comms = [world.Dup() for _ in range(threads)]
workers = [
    threading.Thread(target=mpigpu.allreduce, args=(np.ones(3),), kwargs={"comm": c, "backend": "host"}) for c in comms
]
faulthandler.dump_traceback_later(limit, exit=True)
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
sys.stdout.write(f"rank {rank}: {rounds} rounds of {threads} threads done\\n")
"""


@pytest.mark.parametrize(
    ("n", "rounds", "check"),
    [(2, ROUNDS, "1"), (2, ROUNDS // 4, "0"), (4, 3, "1")],  # 4 ranks of 8 threads on 2 cores: ~5 s a round
    ids=["2-ranks", "2-ranks-no-check", "4-ranks"],
)
def test_a_communicator_per_thread_never_hangs(tmp_path: Path, n: int, rounds: int, check: str) -> None:
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    result = run_mpi(
        n, [str(script), str(THREADS), str(rounds), str(ROUND_LIMIT_S)], timeout=120, env={"MPIGPU_CHECK": check}
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"after {time.monotonic() - start:.1f} s:\n{output}"
    for rank in range(n):
        assert f"rank {rank}: {rounds} rounds of {THREADS} threads done" in result.stdout, output
