"""No failure in mpigpu.horovod.torch leaves the ranks one call apart (issue 22, section 3).

Each program runs under its own ``mpiexec -n 2`` with a time limit: one rank raises inside the layer
(a bad argument, a Python error before the call reaches mpigpu, a rank outside a process set, a name
already in flight), every rank raises for that call, and ten more calls pair correctly. Before the
fix these programs hung until killed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import run_mpi

pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

LIMIT_S = 90

PREAMBLE = """
import sys
import torch
import mpigpu.horovod.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()


def ten_more_calls():
    for i in range(10):
        x = torch.full((5,), float(r + i), dtype=torch.float64)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"after{i}")
        assert torch.equal(got, torch.full((5,), float(sum(k + i for k in range(n))), dtype=torch.float64)), got


def raises(kinds, call):
    try:
        call()
    except kinds as exc:
        return type(exc).__name__
    raise AssertionError(f"rank {r}: no error")
"""

# rank 1 alone rejects the call inside the layer; rank 0 gets HorovodInternalError for that call
ONE_RANK_REJECTS = (
    PREAMBLE
    + """
x = torch.ones(4)


class Broken:
    @staticmethod
    def compress(tensor):
        raise KeyError("compressor failed")


cases = [
    ("op", lambda: hvd.allreduce(x, op=hvd.Adasum if r == 1 else hvd.Sum), NotImplementedError),
    ("compression", lambda: hvd.allreduce(x, compression=Broken if r == 1 else hvd.Compression.none), KeyError),
    ("root_rank", lambda: hvd.broadcast(x, root_rank=n if r == 1 else 0), ValueError),
    ("not a tensor", lambda: hvd.allgather(x if r == 0 else [1.0]), ValueError),
    ("grouped dtypes", lambda: hvd.grouped_allreduce([x, x.double() if r == 1 else x]), RuntimeError),
    ("object root", lambda: hvd.broadcast_object(1, root_rank=n if r == 1 else 0), ValueError),
    ("sparse", lambda: hvd.sparse_allreduce_async(x.to_sparse() if r == 0 else x)(), ValueError),
]
for label, call, own in cases:
    kind = raises((own, hvd.HorovodInternalError), call)
    expected = own.__name__ if r == 1 else "HorovodInternalError"
    assert kind == expected, (label, kind, expected)
    ten_more_calls()

# a rank outside a process set: it raises, the set's ranks do not wait for it
solo = hvd.add_process_set([0])
if r == 1:
    assert raises(ValueError, lambda: hvd.allreduce(x, process_set=solo)) == "ValueError"
else:
    assert torch.equal(hvd.allreduce(x, process_set=solo), x)
hvd.remove_process_set(solo)
ten_more_calls()
sys.stdout.write(f"OK {r}\\n")
"""
)

# Horovod's names and asynchrony: rank 0 starts three calls and a duplicate-named one before rank 1
# starts any; they are in flight (poll False) until rank 1 calls; barrier does not wait for them
IN_FLIGHT = (
    PREAMBLE
    + """
x = torch.full((17,), float(r + 1))


def start():
    handles = [
        hvd.allgather_async(x, name="gather"),
        hvd.broadcast_async(x, root_rank=0, name="bcast"),
        hvd.allreduce_async(x, op=hvd.Sum, name="reduce"),
    ]
    polled = [hvd.poll(h) for h in handles]
    assert raises(ValueError, lambda: hvd.allgather_async(x, name="gather")) == "ValueError"
    assert raises(ValueError, lambda: hvd.allreduce_async(x, name="reduce")) == "ValueError"
    return handles, polled


if r == 0:
    handles, polled = start()
    assert polled == [False, False, False], polled  # rank 1 has not called yet
    hvd.barrier()
else:
    hvd.barrier()
    handles, polled = start()
gathered, broadcast, reduced = (hvd.synchronize(h) for h in handles)
assert torch.equal(gathered, torch.cat([torch.full((17,), float(k + 1)) for k in range(n)]))
assert torch.equal(broadcast, torch.ones(17))
assert torch.equal(reduced, torch.full((17,), float(sum(k + 1 for k in range(n)))))
again = hvd.allgather_async(x, name="gather")  # the name is free once its call is synchronized
assert hvd.synchronize(again).shape == (17 * n,)
ten_more_calls()
sys.stdout.write(f"OK {r}\\n")
"""
)


@pytest.mark.parametrize(("program", "label"), [(ONE_RANK_REJECTS, "one rank rejects"), (IN_FLIGHT, "in flight")])
def test_no_failure_leaves_the_ranks_one_call_apart(tmp_path: Path, program: str, label: str) -> None:
    script = tmp_path / "program.py"
    script.write_text(program)
    started = time.monotonic()
    done = run_mpi(2, [str(script)], timeout=LIMIT_S, env={"MPIGPU_ABORT_ON_EXCEPTION": "0"})
    elapsed = time.monotonic() - started
    assert done.returncode == 0, f"{label}: status {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "OK 0" in done.stdout and "OK 1" in done.stdout, done.stdout + done.stderr
    assert elapsed < LIMIT_S
