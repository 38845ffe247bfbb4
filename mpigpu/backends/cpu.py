"""NumPy arrays through the MPI library's own MPI_Allreduce: the path for machines with no GPU,
and the latency path for small host messages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mpigpu._mpi import MPI
from mpigpu.backends.base import Availability, Backend
from mpigpu.ops import Op, finish_avg

if TYPE_CHECKING:
    from mpigpu._cuda import StreamRef
    from mpigpu.arrays import ArrayView
    from mpigpu.context import Context

__all__ = ["CpuBackend", "mpi_datatype", "mpi_op"]


def mpi_datatype(name: str) -> Any:
    """The MPI datatype of a (non-half) element type."""
    mpi = MPI()
    return {
        "float32": mpi.FLOAT, "float64": mpi.DOUBLE,
        "int8": mpi.INT8_T, "uint8": mpi.UINT8_T, "int16": mpi.INT16_T, "uint16": mpi.UINT16_T,
        "int32": mpi.INT32_T, "uint32": mpi.UINT32_T, "int64": mpi.INT64_T, "uint64": mpi.UINT64_T,
    }[name]  # fmt: skip


def mpi_op(op: Op) -> Any:
    """The MPI operation that combines like ``op`` (avg combines as sum)."""
    mpi = MPI()
    return {Op.SUM: mpi.SUM, Op.MIN: mpi.MIN, Op.MAX: mpi.MAX, Op.PROD: mpi.PROD}[op.base]


class CpuBackend(Backend):
    """MPI_Allreduce on host memory; float16/bfloat16 go through a reused float32 buffer."""

    name: ClassVar[str] = "cpu"
    code: ClassVar[int] = 1
    host_arrays: ClassVar[bool] = True
    device_arrays: ClassVar[bool] = False

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._acc = np.empty(0, np.float32)

    @classmethod
    def probe(cls, ctx: Context) -> Availability:
        return Availability(True, f"NumPy arrays through {ctx.mpi_lib.name}'s MPI_Allreduce")

    def _accumulator(self, size: int) -> np.ndarray:
        if self._acc.size < size:
            self._acc = np.empty(size, np.float32)
        return self._acc[:size]

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        assert x.host is not None and out.host is not None
        comm, nranks, dtype = self.ctx.comm, self.ctx.size, x.dtype
        src, dst = x.host.reshape(-1), out.host.reshape(-1)
        if dtype.is_half:  # reduce in float32, round once
            acc = self._accumulator(src.size)
            acc[...] = src
            comm.Allreduce(MPI().IN_PLACE, [acc, MPI().FLOAT], mpi_op(op))
            with np.errstate(over="ignore"):  # overflow to inf is IEEE behaviour, not an error
                if op is Op.AVG:
                    finish_avg(acc, nranks, dtype, dst)
                else:
                    dst[...] = acc.astype(dtype.np)
            return
        kind = mpi_datatype(dtype.name)
        if x.same_memory(out):
            comm.Allreduce(MPI().IN_PLACE, [dst, kind], mpi_op(op))
        else:
            comm.Allreduce([src, kind], [dst, kind], mpi_op(op))
        if op is Op.AVG:
            finish_avg(dst, nranks, dtype, dst)

    def describe(self) -> dict[str, Any]:
        return {"transport": "MPI_Allreduce"}
