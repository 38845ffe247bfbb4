"""NumPy arrays through the MPI library's own MPI_Allreduce: the path for machines with no GPU,
and the latency path for small host messages.

Only order-independent reductions are handed to MPI as they are (MPICH combines operands in a
different order on each rank): float min/max travel as order-preserving integer keys reduced with
MPI's integer MIN/MAX, integer avg as 64-bit parts summed exactly (mpigpu.core.ops), and any NaN a float
sum or product leaves is made the canonical NaN, whose bits then match on every rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mpigpu.backends.base import Availability, Backend, CommContext
from mpigpu.backends.mpi_moves import allgather_bytes, alltoall_bytes, broadcast_bytes, byte_counts, row_bytes
from mpigpu.core._mpi import MPI
from mpigpu.core.arrays import ArrayView
from mpigpu.core.ops import Op, canonicalize_nan, finish_avg, from_keys, int_avg_join, int_avg_parts, to_keys

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef

__all__ = ["INT_AVG_BLOCK", "CpuBackend"]

# Elements per MPI_Allreduce of an integer average. Its 64-bit parts and their temporaries take about
# 32 bytes per element (24x an int8 array when done at once), so a block bounds them at ~8 MiB
# whatever the array's size; each block is 2 MiB or more on the wire, where one more call is cheap.
INT_AVG_BLOCK = 1 << 18


def _same_nan(dst: np.ndarray, probe: np.ndarray) -> None:
    """Make every NaN in ``dst`` the canonical NaN: MPI's operand order picks which NaN's sign and
    payload survive a sum. ``probe`` (dst or its float32 accumulator) holds a NaN wherever dst does;
    its sum is NaN if any element is (or if +inf meets -inf: harmless, the fix-up then finds none)."""
    with np.errstate(all="ignore"):
        if np.isnan(np.add.reduce(probe)):
            canonicalize_nan(dst)


class CpuBackend(Backend):
    """MPI_Allreduce on host memory; float16/bfloat16 go through a reused float32 buffer."""

    name: ClassVar[str] = "cpu"
    host_arrays: ClassVar[bool] = True
    device_arrays: ClassVar[bool] = False
    anchors: ClassVar[Mapping[str, str]] = {"host": "mpi-host"}
    collectives: ClassVar[frozenset[str]] = frozenset(
        {"allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"}
    )

    def __init__(self, ctx: CommContext) -> None:
        super().__init__(ctx)
        self._acc = np.empty(0, np.float32)
        self._full = np.empty(0, np.uint8)  # reduce_scatter's whole result

    @classmethod
    def probe(cls, ctx: CommContext) -> Availability:
        return Availability(True, f"NumPy arrays through {ctx.mpi_lib.name}'s MPI_Allreduce")

    def _accumulator(self, size: int) -> np.ndarray:
        if self._acc.size < size:
            self._acc = np.empty(size, np.float32)
        return self._acc[:size]

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        assert x.host is not None and out.host is not None
        comm, nranks, dtype = self.ctx.comm, self.ctx.size, x.dtype
        src, dst = x.host.reshape(-1), out.host.reshape(-1)
        if dtype.is_float and op in (Op.MIN, Op.MAX):  # keys: MPI's integer MIN/MAX is order-independent
            keys = to_keys(src, op)
            comm.Allreduce(MPI().IN_PLACE, [keys, dtype.unsigned.mpi], op.mpi)
            from_keys(keys, dst)
            return
        if op is Op.AVG and not dtype.is_float:  # exact: 64-bit parts cannot overflow
            for b0 in range(0, src.size, INT_AVG_BLOCK):  # every rank the same blocks: they pair
                b1 = min(src.size, b0 + INT_AVG_BLOCK)
                parts = int_avg_parts(src[b0:b1], nranks)
                comm.Allreduce(MPI().IN_PLACE, [parts, MPI().UINT64_T], MPI().SUM)
                int_avg_join(parts, nranks, dst[b0:b1])
            return
        if dtype.is_half:  # reduce in float32, round once
            acc = self._accumulator(src.size)
            acc[...] = src
            comm.Allreduce(MPI().IN_PLACE, [acc, MPI().FLOAT], op.mpi)
            with np.errstate(over="ignore"):  # overflow to inf is IEEE behaviour, not an error
                if op is Op.AVG:
                    finish_avg(acc, nranks, dtype, dst)
                else:
                    dst[...] = acc.astype(dtype.np)
            _same_nan(dst, acc)
            return
        kind = dtype.mpi
        if x.same_memory(out):
            comm.Allreduce(MPI().IN_PLACE, [dst, kind], op.mpi)
        else:
            comm.Allreduce([src, kind], [dst, kind], op.mpi)
        if op is Op.AVG:
            finish_avg(dst, nranks, dtype, dst)
        if dtype.is_float:
            _same_nan(dst, dst)

    def broadcast(self, x: ArrayView, root: int, stream: StreamRef | None) -> None:
        """MPI_Bcast of x's bytes from ``root``, in place."""
        assert x.host is not None
        broadcast_bytes(self.ctx.comm, x.host.reshape(-1).view(np.uint8), x.nbytes, root)

    def allgather(self, x: ArrayView, out: ArrayView, rows: list[int], stream: StreamRef | None) -> None:
        """MPI_Allgatherv of every rank's rows into ``out``."""
        assert x.host is not None and out.host is not None
        row_bytes = out.nbytes // sum(rows)
        send, recv = x.host.reshape(-1).view(np.uint8), out.host.reshape(-1).view(np.uint8)
        allgather_bytes(self.ctx.comm, send, recv, rows, row_bytes)

    def reduce_scatter(self, x: ArrayView, out: ArrayView, op: Op, rows: list[int], stream: StreamRef | None) -> None:
        """This backend's allreduce into a private buffer, then this rank's rows into ``out``.

        Not MPI_Reduce_scatter: MPICH combines its operands in an order of its own per rank, so a
        float sum could differ in its last bits from allreduce's. Reducing the whole message costs
        what MPI_Allreduce costs (about twice a reduce-scatter's bytes), which on this path, the one
        for small host messages, is latency; in return every rule of allreduce (keys for float
        min/max, exact integer avg, float32 for the half types, canonical NaN) holds as it is and
        the result is allreduce's, bit for bit, on every rank."""
        assert out.host is not None
        if self._full.nbytes < x.nbytes:
            self._full = np.empty(x.nbytes, np.uint8)
        full = self._full[: x.nbytes].view(x.dtype.np)
        self.allreduce(x, ArrayView(full, full.ctypes.data, (x.size,), x.dtype, None, False, "numpy", host=full),
                       op, stream)  # fmt: skip
        counts, displs = byte_counts(rows, row_bytes(x.shape, x.dtype.itemsize))
        mine = self.ctx.rank
        out.host.reshape(-1).view(np.uint8)[...] = full.view(np.uint8)[displs[mine] : displs[mine] + counts[mine]]

    def alltoall(
        self, x: ArrayView, out: ArrayView, send_rows: list[int], recv_rows: list[int], stream: StreamRef | None
    ) -> None:
        """MPI_Alltoallv of x's rows."""
        assert x.host is not None and out.host is not None
        send, recv = x.host.reshape(-1).view(np.uint8), out.host.reshape(-1).view(np.uint8)
        alltoall_bytes(self.ctx.comm, send, recv, send_rows, recv_rows, row_bytes(x.shape, x.dtype.itemsize))

    def describe(self) -> dict[str, Any]:
        return {"transport": "MPI_Allreduce, MPI_Bcast, MPI_Allgatherv, MPI_Alltoallv"}
