"""The backend registry: each backend describes itself, and the tables derived from it say what the
hand-written ones said before (auto's order, stream ordering, graphs, the bench anchors)."""

from __future__ import annotations

import pytest

from mpigpu.backends import BACKEND_NAMES, backend_class, backend_code, preference
from mpigpu.bench import anchors
from mpigpu.core.errors import InvalidArgument
from mpigpu.job.check import COLLECTIVES


def test_names_and_codes() -> None:
    assert [backend_class(n).name for n in BACKEND_NAMES] == list(BACKEND_NAMES)
    codes = [backend_code(n) for n in BACKEND_NAMES]
    assert len(set(codes)) == len(codes) and 0 not in codes  # 0 is the signature of a rank reporting an error
    with pytest.raises(InvalidArgument, match="unknown backend 'nope'"):
        backend_code("nope")


def test_auto_preference_is_the_registry_order() -> None:
    assert preference(True) == ("ipc", "nccl", "cuda-aware", "host")
    assert preference(False) == ("host", "cpu")
    assert preference(True, "broadcast") == ("nccl", "cuda-aware", "host")  # ipc implements allreduce only
    assert preference(False, "allgather") == ("host", "cpu")
    # ipc makes reduce_scatter out of a whole allreduce: nccl's reduceScatter first
    assert preference(True, "reduce_scatter") == ("nccl", "ipc", "cuda-aware", "host")
    assert preference(False, "alltoall") == ("host", "cpu")
    assert preference(True, "reduce") == ()  # no backend implements it


# what each backend is reported beside in the benchmark
PAIRS = {
    ("device", "nccl"): "nccl-raw",
    ("device", "ipc"): "nccl-raw",
    ("device", "cuda-aware"): "mpi-device",
    ("device", "host"): "seed-staging",
    ("host", "cpu"): "mpi-host",
    ("host", "host"): "mpi-host",
}


def test_self_description() -> None:
    assert {n for n in BACKEND_NAMES if backend_class(n).enqueues} == {"nccl", "ipc"}
    assert {n for n in BACKEND_NAMES if backend_class(n).graphs} == {"nccl", "ipc"}
    moves = frozenset({"allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"})
    assert {n: backend_class(n).collectives for n in BACKEND_NAMES} == {
        "ipc": frozenset({"allreduce", "reduce_scatter"}),
        "nccl": moves, "cuda-aware": moves, "host": moves, "cpu": moves,
    }  # fmt: skip
    assert moves <= set(COLLECTIVES)
    for name in BACKEND_NAMES:
        cls = backend_class(name)
        for placement in ("device", "host"):
            takes = cls.device_arrays if placement == "device" else cls.host_arrays
            assert cls.anchors.get(placement) == anchors.anchor_for(placement, name) == PAIRS.get((placement, name))
            assert takes or placement not in cls.anchors


def test_auto_size_rules() -> None:
    ipc, host = backend_class("ipc"), backend_class("host")
    assert ipc.auto_declines(True, 4 << 20) is None
    assert ipc.auto_declines(True, (4 << 20) + 1) == "message above 4 MiB"
    outside = "message below 32 MiB and outside 32 KiB-64 KiB, 2 MiB-32 MiB (MPI_Allreduce is faster there)"
    for nbytes in (8, (32 << 10) - 1, (64 << 10) + 1, (2 << 20) - 1):
        assert host.auto_declines(False, nbytes) == outside, nbytes
    for nbytes in (32 << 10, 64 << 10, 2 << 20, (3 << 20) + 1, 8 << 20, (32 << 20) - 1, 32 << 20, 1 << 40):
        assert host.auto_declines(False, nbytes) is None, nbytes
        assert host.auto_declines(False, nbytes, "reduce_scatter") is None, nbytes
        if nbytes < 32 << 20:  # the windows are the reductions': allgather's sizes differ between ranks
            assert host.auto_declines(False, nbytes, "allgather") == "message below 32 MiB (MPI is as fast there)"
    assert host.auto_declines(True, 1) is None
    assert all(backend_class(n).auto_declines(True, 1 << 40) is None for n in ("nccl", "cuda-aware", "cpu"))


def test_mpi_and_numpy_mappings_live_on_dtype_and_op() -> None:
    """One table per fact: DType.mpi, DType.unsigned, Op.mpi and Op.ufunc (were copies in backends)."""
    import numpy as np

    from mpigpu.core._mpi import MPI
    from mpigpu.core.dtypes import DTYPES
    from mpigpu.core.ops import Op

    mpi = MPI()
    for d in DTYPES.values():
        assert d.unsigned.np == np.dtype(f"uint{8 * d.itemsize}")
        if d.is_half:
            with pytest.raises(InvalidArgument, match="float32 or as keys"):
                _ = d.mpi
            continue
        assert d.mpi.Get_size() == d.itemsize
        assert d.mpi == {"float32": mpi.FLOAT, "float64": mpi.DOUBLE}.get(d.name, getattr(mpi, f"{d.name.upper()}_T"))
    assert [op.mpi for op in Op] == [mpi.SUM, mpi.SUM, mpi.MIN, mpi.MAX, mpi.PROD]
    assert [op.ufunc for op in Op] == [np.add, np.add, np.minimum, np.maximum, np.multiply]
