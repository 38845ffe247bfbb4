"""NumPy arrays through the MPI library's own MPI_Allreduce: the path for machines with no GPU,
and the latency path for small host messages.

Only order-independent reductions are handed to MPI as they are (MPICH combines operands in a
different order on each rank): float min/max travel as order-preserving integer keys reduced with
MPI's integer MIN/MAX, integer avg as the sum in the narrowest integer type that cannot overflow
(int8 at up to 256 ranks: int16), else (64-bit types) as 64-bit parts summed exactly
(mpigpu.core.ops). Integer sum,
prod, min and max go to MPI as they are, with no pass of mpigpu's own over the data.

Float sum, avg and prod are MPI's own, but MPI's operand order differs per rank, and where two NaNs
meet the CPU keeps the first operand's bits (x86): ranks whose inputs hold different NaNs can end
with different NaNs in one element. So the result is read once more for NaN (one pass of
``np.maximum.reduce``, which propagates NaN; for avg fused with the division, block by block, while
the block is in cache) and any NaN is made the canonical NaN, whose bits then match on every rank.
That pass is the one mpigpu adds to MPI_Allreduce; bench/results/README.md gives its measured cost. Up to
the check board's DATA_BYTES on one node no MPI call runs at all (mpigpu.backends.cpu_board: every
rank reduces every rank's posted data in rank order, then the same NaN rule). Non-NaN results need no
pass: IEEE addition and multiplication are commutative, and MPICH's algorithms either compute an
element on one rank and copy it or have two ranks combine the same two partial results, so only a
NaN's payload (x86 keeps the first operand's) can differ between ranks.

Across nodes that each hold 2 ranks or more, from SPLIT_FROM bytes (``splits``), a plain reduction is
MPI_Reduce_scatter, then this rank's block finished (avg's division, the NaN rule: 1/N of the read),
then MPI_Allgatherv: MPICH's allreduce across such nodes is slower than the two (measured in
bench/results/README.md), and each element is reduced on one rank, so the bits match everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mpigpu.backends.base import Availability, Backend, CommContext
from mpigpu.backends.mpi_moves import allgather_bytes, alltoall_bytes, broadcast_bytes, row_bytes
from mpigpu.core._mpi import MPI
from mpigpu.core.arrays import ArrayView
from mpigpu.core.dtypes import DTYPES, DType
from mpigpu.core.ops import Op, canonicalize_nan, finish_avg, from_keys, int_avg_join, int_avg_parts, to_keys

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef

__all__ = ["INT_AVG_BLOCK", "CpuBackend", "has_nan"]

# Elements per MPI_Allreduce of an integer average. Its 64-bit parts and their temporaries take about
# 32 bytes per element (24x an int8 array when done at once), so a block bounds them at ~8 MiB
# whatever the array's size; each block is 2 MiB or more on the wire, where one more call is cheap.
INT_AVG_BLOCK = 1 << 18
# Elements per MPI_Allreduce of an integer average summed in a wider integer (_wide_sum): few calls
# (each one waits for every rank), at most 32 MiB of widened block; its quotient is taken _AVG_BLOCK
# elements at a time, in cache from the division to the narrowing.
WIDE_AVG_BLOCK = 1 << 22
# Elements per block of a float average's division and NaN search: the search reads what the
# division just wrote while it is in cache (256 KiB of float32).
_AVG_BLOCK = 1 << 16
_SMALL = 16  # up to this many elements, the NaN search is a Python sum (a ufunc's call costs more)
# From this many bytes, across nodes that each hold 2 ranks or more, a plain reduction goes as
# MPI_Reduce_scatter, this rank's block finished (avg's division, the NaN rule), then MPI_Allgatherv: on
# MPICH 5.0.2 across fork-launched nodes 0.51-0.94x MPI_Allreduce with the NaN read at 64 KiB-8 MiB
# (2x4, 3x3, 4x2), where one node or one rank per node gave 1.12-1.65x (bench/results/README.md).
SPLIT_FROM = 64 << 10

# (stream, source, destination): one allreduce, all else fixed; the shape of a bound launch, so that a
# call record's launch is the reduction itself (the stream is unused: host memory)
Reduce = Callable[[Any, np.ndarray, np.ndarray], None]


def has_nan(values: np.ndarray) -> bool:
    """Whether the float array ``values`` holds a NaN (or, for at most _SMALL elements, +inf and -inf,
    whose sum is NaN: a false alarm costs the fix-up a pass that finds nothing). One read."""
    if values.size <= _SMALL and values.ndim == 1:
        total = sum(values.tolist())
        return total != total
    top = np.maximum.reduce(values, axis=None)  # NaN in, NaN out; no floating-point warning (an errstate costs ~1 us)
    return bool(top != top)


def _divide_has_nan(values: np.ndarray, nranks: int) -> bool:
    """values /= nranks (IEEE division, in place), and whether the quotient holds a NaN: the search
    fused with the division, a block at a time. No errstate (~1 us a call): dividing by a rank count
    cannot overflow or divide by zero, and a quiet NaN raises nothing (only a signalling NaN in the
    input, which no arithmetic makes, would show NumPy's RuntimeWarning)."""
    n = values.dtype.type(nranks)
    if values.size <= _AVG_BLOCK:
        np.divide(values, n, out=values)
        return has_nan(values)
    flat = values.reshape(-1)
    found = False
    for b0 in range(0, flat.size, _AVG_BLOCK):
        block = flat[b0 : b0 + _AVG_BLOCK]
        np.divide(block, n, out=block)
        found = has_nan(block) or found
    return found


def _wide_sum(dtype: DType, nranks: int) -> DType | None:
    """For the exact integer average of ``dtype`` over ``nranks`` ranks: the narrowest integer type in
    which the sum over the ranks cannot overflow (MPI sums it exactly, in any order). None: 64-bit parts."""
    bits = 8 * dtype.itemsize
    signed = dtype.np.kind == "i"
    largest = nranks << (bits - 1) if signed else nranks * ((1 << bits) - 1)  # |sum| at most
    for wide in (2 * bits, 4 * bits):
        if wide <= 64 and largest <= (1 << (wide - 1) if signed else (1 << wide) - 1):
            return DTYPES[f"{'' if signed else 'u'}int{wide}"]
    return None


def _truncated_quotient(total: np.ndarray, nranks: int, scratch: np.ndarray, out: np.ndarray) -> None:
    """out = total / nranks, truncated toward zero as C divides (``scratch``: as many of total's type).
    A negative total t is first raised by nranks - 1, so that NumPy's floor division (by a constant:
    SIMD) gives ceil(t / nranks); that sum cannot overflow (t <= -1)."""
    n = total.dtype.type(nranks)
    if total.dtype.kind == "i":
        np.right_shift(total, 8 * total.dtype.itemsize - 1, out=scratch)  # -1 where negative, else 0
        np.bitwise_and(scratch, total.dtype.type(nranks - 1), out=scratch)
        np.add(total, scratch, out=scratch)
        np.floor_divide(scratch, n, out=scratch)
    else:
        np.floor_divide(total, n, out=scratch)
    out[...] = scratch


def is_plain(dtype: DType, op: Op) -> bool:
    """Whether MPI_Allreduce takes the call as it is: not float min/max (keys), integer avg (parts)
    or the half types (float32)."""
    if dtype.is_half:
        return False
    if dtype.is_float:
        return op not in (Op.MIN, Op.MAX)
    return op is not Op.AVG


def splits(node_sizes: tuple[int, ...], nbytes: int) -> bool:
    """Whether a plain reduction of ``nbytes`` goes as reduce-scatter and allgather (``SPLIT_FROM``): on
    several nodes that each hold 2 ranks or more. ``node_sizes`` is the same on every rank, and so is
    the answer (the check has made ``nbytes`` the same): every rank makes the same MPI calls."""
    return nbytes >= SPLIT_FROM and len(node_sizes) > 1 and min(node_sizes) >= 2


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
        self._blocks = np.empty(0, np.uint8)  # an integer average's widened block and a part's quotient
        self._split_block = np.empty(0, np.uint8)  # this rank's block of a split reduction (``splits``)
        self._reducers: dict[tuple[str, Op, bool, bool], Reduce] = {}

    @classmethod
    def probe(cls, ctx: CommContext) -> Availability:
        return Availability(True, f"NumPy arrays through {ctx.mpi_lib.name}'s MPI_Allreduce")

    def _accumulator(self, size: int) -> np.ndarray:
        if self._acc.size < size:
            self._acc = np.empty(size, np.float32)
        return self._acc[:size]

    def _block_buffers(self, wide: np.dtype, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Reused arrays of ``wide``: ``size`` elements (the widened block) and _AVG_BLOCK (a part's
        quotient)."""
        split = _AVG_BLOCK * wide.itemsize
        total = split + size * wide.itemsize
        if self._blocks.size < total:
            self._blocks = np.empty(total, np.uint8)
        return self._blocks[split:total].view(wide), self._blocks[:split].view(wide)

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        assert x.host is not None and out.host is not None
        self._reducer(x.dtype, op, x.same_memory(out), x.nbytes)(stream, x.host, out.host)

    def bind_allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> Callable[..., None]:
        """The reduction for x's dtype, the op and in-place-or-not chosen once: a call is MPI_Allreduce
        (and, for floats, the NaN search) on the arrays it is lent, or on the views' own. A call
        record's views hold no array (every call lends its own): its launch is the reduction itself."""
        reduce = self._reducer(x.dtype, op, x.same_memory(out), x.nbytes)
        own_x, own_out = x.host, out.host
        if own_x is None:
            return reduce

        def call(stream: StreamRef | None, x_host: Any = None, out_host: Any = None) -> None:
            if x_host is None:
                reduce(stream, own_x, own_out)
            else:
                reduce(stream, x_host, out_host)

        return call

    def _reducer(self, dtype: DType, op: Op, in_place: bool, nbytes: int) -> Reduce:
        """The allreduce of (source, destination) arrays of ``dtype`` with ``op`` and ``nbytes`` (made
        once per case: the size only picks ``splits``' route or not)."""
        split = is_plain(dtype, op) and splits(self.ctx.layout.node_sizes, nbytes)
        key = (dtype.name, op, in_place, split)
        found = self._reducers.get(key)
        if found is None:
            found = self._reducers[key] = self._make(dtype, op, in_place, split)
        return found

    def _make(self, dtype: DType, op: Op, in_place: bool, split: bool) -> Reduce:
        if split:
            return self._split(dtype, op)
        if is_plain(dtype, op):
            return self._plain(self.ctx.comm, dtype, op, in_place)
        comm, nranks, mpi = self.ctx.comm, self.ctx.size, MPI()
        if dtype.is_float and op in (Op.MIN, Op.MAX):  # keys: MPI's integer MIN/MAX is order-independent
            keys_type, mpi_op = dtype.unsigned.mpi, op.mpi

            def by_keys(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
                keys = to_keys(src.reshape(-1), op)
                comm.Allreduce(mpi.IN_PLACE, [keys, keys_type], mpi_op)
                from_keys(keys, dst.reshape(-1))

            return by_keys
        wide = _wide_sum(dtype, nranks) if op is Op.AVG and not dtype.is_float else None
        if wide is not None:  # exact: the wide sum cannot overflow
            wire_type = wide.mpi

            def by_wide_sum(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
                src, dst = src.reshape(-1), dst.reshape(-1)
                acc, scratch = self._block_buffers(wide.np, min(src.size, WIDE_AVG_BLOCK))
                for b0 in range(0, src.size, WIDE_AVG_BLOCK):  # every rank the same blocks: they pair
                    b1 = min(src.size, b0 + WIDE_AVG_BLOCK)
                    block = acc[: b1 - b0]
                    block[...] = src[b0:b1]
                    comm.Allreduce(mpi.IN_PLACE, [block, wire_type], mpi.SUM)
                    for c0 in range(0, block.size, _AVG_BLOCK):
                        part = block[c0 : c0 + _AVG_BLOCK]
                        _truncated_quotient(part, nranks, scratch[: part.size], dst[b0 + c0 : b0 + c0 + part.size])

            return by_wide_sum
        if op is Op.AVG and not dtype.is_float:  # exact: 64-bit parts cannot overflow

            def by_parts(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
                src, dst = src.reshape(-1), dst.reshape(-1)
                for b0 in range(0, src.size, INT_AVG_BLOCK):  # every rank the same blocks: they pair
                    b1 = min(src.size, b0 + INT_AVG_BLOCK)
                    parts = int_avg_parts(src[b0:b1], nranks)
                    comm.Allreduce(mpi.IN_PLACE, [parts, mpi.UINT64_T], mpi.SUM)
                    int_avg_join(parts, nranks, dst[b0:b1])

            return by_parts
        if dtype.is_half:  # reduce in float32, round once
            mpi_op = op.mpi

            def in_float32(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
                src, dst = src.reshape(-1), dst.reshape(-1)
                acc = self._accumulator(src.size)
                acc[...] = src
                comm.Allreduce(mpi.IN_PLACE, [acc, mpi.FLOAT], mpi_op)
                with np.errstate(over="ignore"):  # overflow to inf is IEEE behaviour, not an error
                    if op is Op.AVG:
                        finish_avg(acc, nranks, dtype, dst)
                    else:
                        dst[...] = acc.astype(dtype.np)
                if has_nan(acc):  # acc holds a NaN wherever dst does
                    canonicalize_nan(dst)

            return in_float32
        raise AssertionError(f"no reduction for {dtype.name} {op.value}")

    def _split(self, dtype: DType, op: Op) -> Reduce:
        """A plain reduction as ``splits`` routes it: MPI_Reduce_scatter of the source into this rank's
        block, the block finished (avg's division; for floats the NaN rule, over 1/N of the elements),
        then MPI_Allgatherv of the blocks into the destination. Each element is reduced on one rank and
        copied to the others, so the bits are the same on every rank. In place or not alike: MPI reads
        the whole source before the destination is written."""
        comm, kind, mpi_op, rank, nranks = self.ctx.comm, dtype.mpi, op.mpi, self.ctx.rank, self.ctx.size
        is_float, is_avg = dtype.is_float, op is Op.AVG  # integer avg is never plain
        counts_of: dict[int, tuple[list[int], list[int]]] = {}  # elements -> every rank's block and offset

        def split(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
            size = src.size
            found = counts_of.get(size)
            if found is None:
                if len(counts_of) >= 64:
                    counts_of.clear()
                base, extra = divmod(size, nranks)
                counts = [base + (r < extra) for r in range(nranks)]
                found = counts_of[size] = (counts, [base * r + min(r, extra) for r in range(nranks)])
            counts, offsets = found
            nbytes = counts[rank] * dtype.itemsize
            if self._split_block.size < nbytes:
                self._split_block = np.empty(nbytes, np.uint8)
            block = self._split_block[:nbytes].view(dtype.np)
            comm.Reduce_scatter([src.reshape(-1), kind], [block, kind], counts, mpi_op)
            if is_avg:
                if _divide_has_nan(block, nranks):
                    canonicalize_nan(block)
            elif is_float and has_nan(block):
                canonicalize_nan(block)
            comm.Allgatherv([block, kind], [dst.reshape(-1), (counts, offsets), kind])

        return split

    @staticmethod
    def _plain(comm: Any, dtype: DType, op: Op, in_place: bool) -> Reduce:
        """MPI_Allreduce as it is; for floats the NaN search (fused with avg's division). One closure
        per case, so that a call tests nothing it could know beforehand."""
        allreduce, kind, mpi_op, nranks = comm.Allreduce, dtype.mpi, op.mpi, comm.Get_size()
        in_place_buffer = MPI().IN_PLACE

        if not dtype.is_float:  # integers: MPI's result as it is (integer averages go by parts)
            if in_place:
                return lambda stream, src, dst: allreduce(in_place_buffer, [dst, kind], mpi_op)
            return lambda stream, src, dst: allreduce([src, kind], [dst, kind], mpi_op)

        if op is Op.AVG:

            def average(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
                if in_place:
                    allreduce(in_place_buffer, [dst, kind], mpi_op)
                else:
                    allreduce([src, kind], [dst, kind], mpi_op)
                if _divide_has_nan(dst, nranks):
                    canonicalize_nan(dst)

            return average

        if in_place:

            def in_place_float(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
                allreduce(in_place_buffer, [dst, kind], mpi_op)
                if has_nan(dst):
                    canonicalize_nan(dst)

            return in_place_float

        def into_out(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
            allreduce([src, kind], [dst, kind], mpi_op)
            if has_nan(dst):
                canonicalize_nan(dst)

        return into_out

    def broadcast(self, x: ArrayView, root: int, stream: StreamRef | None) -> None:
        """MPI_Bcast of x's bytes from ``root``, in place. The moves hand MPI the C-ordered host arrays
        themselves (MPI_BYTE counts: any dtype; no reshaped view per call)."""
        assert x.host is not None
        broadcast_bytes(self.ctx.comm, x.host, x.nbytes, root)

    def allgather(self, x: ArrayView, out: ArrayView, rows: list[int], stream: StreamRef | None) -> None:
        """MPI_Allgatherv of every rank's rows into ``out``."""
        assert x.host is not None and out.host is not None
        allgather_bytes(self.ctx.comm, x.host, out.host, rows, out.nbytes // sum(rows))

    def reduce_scatter(self, x: ArrayView, out: ArrayView, op: Op, rows: list[int], stream: StreamRef | None) -> None:
        """This backend's allreduce into a private buffer, then this rank's rows into ``out``.

        Not MPI_Reduce_scatter: MPICH combines its operands in an order of its own per rank, so a
        float sum could differ in its last bits from allreduce's. Reducing the whole message costs
        what MPI_Allreduce costs (about twice a reduce-scatter's bytes), which on this path, the one
        for small host messages, is latency; in return every rule of allreduce (keys for float
        min/max, exact integer avg, float32 for the half types, canonical NaN) holds as it is and
        the result is allreduce's, bit for bit, on every rank."""
        self.bind_reduce_scatter(x, op, rows)(x, out, stream)

    def bind_reduce_scatter(self, x: ArrayView, op: Op, rows: list[int]) -> Callable[..., None]:
        """``reduce_scatter`` with the reduction and this rank's elements chosen once: a call is the
        allreduce into the private buffer and one copy of this rank's slice."""
        reduce, nbytes, kind = self._reducer(x.dtype, op, False, x.nbytes), x.nbytes, x.dtype.np
        per_row = row_bytes(x.shape, x.dtype.itemsize) // x.dtype.itemsize
        start = sum(rows[: self.ctx.rank]) * per_row
        stop = start + rows[self.ctx.rank] * per_row

        def launch(xv: ArrayView, outv: ArrayView, stream: StreamRef | None) -> None:
            full = self._full
            if full.nbytes < nbytes:
                full = self._full = np.empty(nbytes, np.uint8)
            whole = full[:nbytes].view(kind)
            reduce(stream, xv.host, whole)  # type: ignore[arg-type]
            outv.host.reshape(-1)[...] = whole[start:stop]  # type: ignore[union-attr]

        return launch

    def alltoall(
        self, x: ArrayView, out: ArrayView, send_rows: list[int], recv_rows: list[int], stream: StreamRef | None
    ) -> None:
        """MPI_Alltoallv of x's rows."""
        assert x.host is not None and out.host is not None
        alltoall_bytes(self.ctx.comm, x.host, out.host, send_rows, recv_rows, row_bytes(x.shape, x.dtype.itemsize))

    def describe(self) -> dict[str, Any]:
        return {"transport": "MPI_Allreduce, MPI_Bcast, MPI_Allgatherv, MPI_Alltoallv"}
