"""The torch.distributed (gloo) anchor of the benchmark, in process under mpiexec -n 1, 2, 3 and 4: it sets up
its own process group from MPI and tears it down, or uses the one a program already initialised and
leaves it alone; its results are verified like every other path's."""

from __future__ import annotations

import json
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mpigpu.bench import main as bench

dist = pytest.importorskip("torch.distributed")
pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch has no gloo backend"),
]

ARGS = ["-e", "32", "--iters", "2", "--repeats", "1", "--warmup", "1", "--quiet", "--placement", "host"]


def _bench(comm: Any, *args: str) -> tuple[int, dict[str, Any]]:
    folder = comm.bcast(tempfile.mkdtemp(prefix="mpigpu-bench-") if comm.Get_rank() == 0 else None, root=0)
    out = Path(folder) / "run.json"
    argv = [*ARGS, "--json", str(out), *args]
    status = bench.run(bench.build_parser().parse_args(argv), ["test", *argv])
    assert len(set(comm.allgather(status))) == 1
    return status, comm.bcast(json.loads(out.read_text()) if comm.Get_rank() == 0 else None, root=0)


def _gloo_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in doc["results"] if r["path"] == "torch-gloo"]


def test_the_anchor_sets_up_its_process_group_and_tears_it_down(comm) -> None:
    assert not dist.is_initialized()
    status, doc = _bench(comm, "--backends", "torch-gloo", "--ops", "sum,avg,min", "--dtypes", "float64,int8")
    rows = _gloo_rows(doc)
    assert status == 0 and len(rows) == 3 * 2 * 2 * 3  # ops x dtypes x modes x sizes
    assert all(r["wrong"] == 0 and r["kind"] == "anchor" and r["call"] is None for r in rows)
    assert not dist.is_initialized(), "the benchmark destroys the process group it created"


def test_the_anchor_uses_a_process_group_already_initialised_and_leaves_it(comm) -> None:
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            address = probe.getsockname()[1]
    port = comm.bcast(address, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(), world_size=comm.Get_size(),
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        status, doc = _bench(comm, "--backends", "torch-gloo", "--corrupt", "1")
        rows = _gloo_rows(doc)
        assert status == 1 and len(rows) == 2 * 3
        assert all(r["wrong"] == 1 for r in rows), "the anchor's results are checked like any path's"
        assert dist.is_initialized(), "a process group the program made is left to the program"
    finally:
        dist.destroy_process_group()


def test_the_torch_reduce_scatter_anchor_makes_its_tensors_once() -> None:
    """Issue 36: the anchor times torch's own call on tensors made once, as a torch user makes them,
    not a conversion per call; new buffers get new tensors."""
    pytest.importorskip("torch")
    import numpy as np

    from mpigpu.bench.coll_anchors import TorchGlooMoves
    from mpigpu.core.arrays import as_view

    anchor = object.__new__(TorchGlooMoves)  # no process group needed to make tensors
    x, out = as_view(np.arange(8, dtype=np.float32)), as_view(np.zeros(4, np.float32))
    first = anchor.typed_tensors(x, out)
    assert anchor.typed_tensors(x, out) is first
    assert str(first[0].dtype) == "torch.float32" and first[0].data_ptr() == x.ptr
    other = as_view(np.zeros(4, np.float32))
    assert anchor.typed_tensors(x, other)[1].data_ptr() == other.ptr
