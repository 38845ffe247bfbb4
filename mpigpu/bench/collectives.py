"""``python -m mpigpu.bench --collective broadcast|allgather|reduce_scatter|alltoall``: what differs
from allreduce.

What is timed: the user's call, ``mpigpu.broadcast(x, root=0[, backend=name])`` (in place),
``y = mpigpu.allgather(x[, backend=name])`` (a new array, ``n x`` the input),
``mpigpu.reduce_scatter(x, "sum", out=y[, backend=name])`` (into ``y``, made once, as a torch user's
output: this rank's share of the sum, split as ``mpigpu.calls.reduce.scatter_rows(count, n)``) or
``y = mpigpu.alltoall(x, splits[, backend=name])`` (splits None where they are even, as torch's
all_to_all_single is called without sizes)
(``splits = scatter_rows(count, n)``: rank r receives its share of every rank's input), beside the
anchors of ``mpigpu.bench.coll_anchors``. Sizes are the per-rank input.

Verification is exact, byte for byte: rank ``r``'s input byte ``j`` of check ``g`` is
``((j % 251) * 7 + 31 r + 17 g + 1) % 251``, so every byte differs between any two ranks (251 is
prime), every check expects bytes no earlier check wrote (an output left over from a previous call
cannot pass), and no pattern byte is the poison 0xFF. Reduce-scatter reduces values, not bytes:
element ``j`` of rank ``r``'s input is ``((j % 251) + 3 r + g) % 8``, small integers whose sums are
exact in every dtype (integers wrap as in C), checked against the sum computed in int64.
Broadcast: every rank must end with the root's (rank 0's) bytes, which differ from its own at every
byte. Allgather: rank ``r``'s block of the
output must hold rank ``r``'s bytes; alltoall: block j of rank r's output must hold rank j's bytes of
share r. The anchors' output is poisoned before the check, and the user call's output is allocated
by the call itself (a block of its size is poisoned and freed first, so the allocator most likely
hands the same memory back).

Bus bandwidth as nccl-tests documents it: broadcast busbw = algbw = bytes / time; allgather
algbw = output bytes / time, busbw = algbw * (n-1)/n; reduce_scatter and alltoall algbw = input
bytes / time, busbw = algbw * (n-1)/n.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from mpigpu.bench.workload import count_changed_device
from mpigpu.calls.reduce import scatter_choice, scatter_rows
from mpigpu.core.arrays import ArrayView, as_view
from mpigpu.core.dtypes import DType
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.timing import Result

__all__ = [
    "COLLECTIVES",
    "MOVES",
    "OUT_CALLS",
    "CollectiveResult",
    "CollectiveWorkload",
    "bind_collective",
    "busbw_factor",
    "refuse_options",
]

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
MOVES = ("broadcast", "allgather", "reduce_scatter", "alltoall")  # the collectives this module times
_NEW_OUTPUT = ("allgather", "reduce_scatter", "alltoall")  # the user's call returns a new array
OUT_CALLS = ("allgather", "alltoall")  # --calls out: the call into an output made once (out=)
ROOT = 0
POISON = 0xFF  # never a pattern byte (patterns are < 251)
_checks = itertools.count(1)  # the salt g of each check, the same sequence on every rank


def busbw_factor(collective: str, nranks: int) -> float:
    """busbw / algbw, as nccl-tests: allreduce 2(n-1)/n, broadcast 1, allgather, reduce_scatter and
    alltoall (n-1)/n (0 for one rank)."""
    if nranks < 2:
        return 0.0
    return 2.0 * (nranks - 1) / nranks if collective == "allreduce" else 1.0 if collective == "broadcast" else (
        (nranks - 1) / nranks
    )  # fmt: skip


@dataclass(frozen=True)
class CollectiveResult(Result):
    """A Result of a collective other than allreduce: ``bytes`` is the per-rank input, ``out_bytes``
    rank 0's output; algbw from the output (allgather) or the input (the others, as nccl-tests)."""

    collective: str = "broadcast"

    @property
    def out_bytes(self) -> int:
        if self.collective == "allgather":
            return self.bytes * self.ranks
        if self.collective in ("reduce_scatter", "alltoall"):
            share = scatter_rows(self.elements, max(1, self.ranks))[0] * (self.bytes // max(1, self.elements))
            return share if self.collective == "reduce_scatter" else share * self.ranks
        return self.bytes

    @property
    def algbw_gbps(self) -> float:
        moved = self.out_bytes if self.collective == "allgather" else self.bytes
        return moved / (self.time_us * 1e3) if self.time_us > 0 else 0.0

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * busbw_factor(self.collective, self.ranks)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["out_bytes"] = self.out_bytes
        return data


def refuse_options(args: Any) -> list[str]:
    """For --collective other than allreduce: raise InvalidArgument for options that have no meaning
    there (ops other than sum, persistent or prepared calls, --tune, the mode the collective has
    not); set ``args.calls`` and ``args.modes``; return lines saying what was set."""
    name = args.collective
    if args.ops != ["sum"]:
        if name == "reduce_scatter":
            raise InvalidArgument("--collective reduce_scatter is timed and verified with op sum: leave out --ops")
        raise InvalidArgument(f"--collective {name} reduces nothing: leave out --ops (only allreduce takes ops)")
    allowed = ["user", *(["out"] if name in OUT_CALLS else [])]
    if args.calls is not None and not set(args.calls) <= set(allowed):
        raise InvalidArgument(
            f"--collective {name} times the user's call only (mpigpu.{name} has no persistent or prepared form): "
            f"use --calls {','.join(allowed)} or leave --calls out"
        )
    if args.tune:
        raise InvalidArgument("--tune measures allreduce's crossover table: run it without --collective")
    inplace = name == "broadcast"  # broadcast writes x in place; the others return a new array
    if (args.out_of_place and inplace) or (args.inplace and not inplace):
        flag = "--out-of-place" if inplace else "--inplace"
        raise InvalidArgument(
            f"{flag} does not apply to --collective {name}: {name} is "
            + ("in place only" if inplace else "out of place only (it returns a new array)")
        )
    args.calls = args.calls or allowed
    args.modes = [inplace]
    setting = {
        "broadcast": f"root rank {ROOT}, in place",
        "allgather": "sizes are each rank's input (the output is n times larger)",
        "reduce_scatter": "op sum; sizes are each rank's input, split as mpigpu.calls.reduce.scatter_rows(count, n)",
        "alltoall": "sizes are each rank's input; splits = mpigpu.calls.reduce.scatter_rows(count, n)",
    }[name]
    busbw = {
        "broadcast": "broadcast busbw = algbw = bytes/time",
        "allgather": "allgather algbw = output bytes/time, busbw = algbw*(n-1)/n",
    }.get(name, f"{name} algbw = input bytes/time, busbw = algbw*(n-1)/n")
    checked = (
        "exact small-integer sums, every element against the int64 reference"
        if name == "reduce_scatter"
        else "byte for byte: every rank's input differs from every other's at every byte"
    )
    return [f"# collective {name}: {setting}", f"# busbw as nccl-tests: {busbw}", f"# verified {checked}"]


# -- the verified buffers ----------------------------------------------------------------------------
def _pattern(xp: Any, nbytes: int, rank: int, salt: int) -> Any:
    """Rank ``rank``'s bytes for check ``salt`` (NumPy or CuPy, on the current stream)."""
    j = xp.arange(nbytes, dtype=xp.uint32) % 251
    return ((j * 7 + (31 * rank + 17 * salt + 1)) % 251).astype(xp.uint8)


@dataclass
class _Arenas:
    x: Any  # uint8, the largest input
    out: Any  # uint8, the anchors' largest output (allgather, reduce_scatter, alltoall), or None


class CollectiveWorkload:
    """Buffers of one call: ``x`` (count elements of dtype), the anchors' output ``out`` (allgather,
    reduce_scatter, alltoall), and ``result``, the array the checked call produced (set by the call)."""

    def __init__(self, collective: str, arenas: _Arenas, count: int, dtype: DType, rank: int, nranks: int,
                 gpu: Any, stream: Any) -> None:  # fmt: skip
        self.collective, self.arenas, self.count, self.dtype = collective, arenas, count, dtype
        self.rank, self.nranks, self.gpu, self.stream = rank, nranks, gpu, stream  # stream: a CuPy stream
        nbytes = count * dtype.itemsize
        self.splits = scatter_rows(count, nranks)  # reduce_scatter's shares, alltoall's splits
        self.x = self._view(arenas.x, nbytes, (count,))
        out_count = self.out_count(collective, count, rank, nranks)
        self.out = self.x if arenas.out is None else self._view(arenas.out, out_count * dtype.itemsize, (out_count,))
        self.result: Any = self.x if collective == "broadcast" else None
        self.salt = 0

    @staticmethod
    def out_count(collective: str, count: int, rank: int, nranks: int) -> int:
        """Elements of rank ``rank``'s output."""
        share = scatter_rows(count, nranks)[rank]
        return {"allgather": count * nranks, "reduce_scatter": share, "alltoall": share * nranks}.get(collective, count)

    @classmethod
    def allocate(cls, collective: str, count: int, dtype: DType, rank: int, nranks: int, gpu: Any,
                 stream: Any) -> CollectiveWorkload:  # fmt: skip
        nbytes = max(1, count * dtype.itemsize)
        xp = _xp(gpu)
        if gpu is not None:
            xp.cuda.Device(gpu.index).use()
        out_bytes = max(1, cls.out_count(collective, count, rank, nranks) * dtype.itemsize)
        arenas = _Arenas(
            xp.empty(nbytes, xp.uint8), xp.empty(out_bytes, xp.uint8) if collective in _NEW_OUTPUT else None
        )
        return cls(collective, arenas, count, dtype, rank, nranks, gpu, stream)

    def sized(self, count: int, **_: Any) -> CollectiveWorkload:
        """The call on ``count`` elements of the same buffers (op and mode: the collective's own)."""
        return CollectiveWorkload(self.collective, self.arenas, count, self.dtype, self.rank, self.nranks, self.gpu,
                                  self.stream)  # fmt: skip

    def _view(self, arena: Any, nbytes: int, shape: tuple[int, ...]) -> ArrayView:
        if self.gpu is None:
            arr = arena[:nbytes].view(self.dtype.np)
            return ArrayView(arr, arr.ctypes.data, shape, self.dtype, None, False, "numpy", host=arr)
        return ArrayView(arena, int(arena.data.ptr), shape, self.dtype, self.gpu.index, False, "cupy")

    def _bytes(self, obj: Any) -> Any:
        """The bytes of an array (view, NumPy, CuPy, torch) as a NumPy or CuPy uint8 array, no copy."""
        view = as_view(obj, name="result")
        if view.on_device:
            from mpigpu.bench.anchors import device_bytes

            return device_bytes(view)
        assert view.host is not None
        return view.host.reshape(-1).view(np.uint8)

    def fill(self) -> None:
        """This rank's input, with a new salt (the same on every rank: one check at a time)."""
        self.salt = next(_checks)
        nbytes = self.count * self.dtype.itemsize
        with self._on_stream():
            if self.collective == "reduce_scatter":
                values = _values(_xp(self.gpu), self.count, self.rank, self.salt)
                self._bytes(self.x)[:] = values.astype(self.dtype.np).view(_xp(self.gpu).uint8)
            else:
                self._bytes(self.x)[:] = _pattern(_xp(self.gpu), nbytes, self.rank, self.salt)

    def poison(self) -> None:
        """The anchors' output, and a block the size of the user call's output, freed again (the
        collectives that return a new array)."""
        if self.collective not in _NEW_OUTPUT:
            return
        xp = _xp(self.gpu)
        self.result = None  # the previous call's output goes back to the allocator first...
        with self._on_stream():
            self._bytes(self.out)[:] = POISON
            block = xp.full(self.out.nbytes, POISON, xp.uint8)  # ...and is poisoned
            del block  # back to the allocator, which a new array of the same size most likely reuses

    def corrupt(self, elements: int) -> None:
        """Testing aid: damage the first ``elements`` of the checked call's result on this rank."""
        if elements > 0 and self.result is not None:
            with self._on_stream():
                limit = min(elements, self.out_count(self.collective, self.count, self.rank, self.nranks))
                self._bytes(self.result)[: limit * self.dtype.itemsize] = POISON

    def wrong(self) -> int:
        """Wrong elements of the result on this rank (every one, when there is no result of the right size)."""
        expected_count = self.out_count(self.collective, self.count, self.rank, self.nranks)
        if self.result is None:
            return expected_count
        got = self._bytes(self.result)
        item = self.dtype.itemsize
        if got.size != expected_count * item:
            return expected_count
        xp = _xp(self.gpu)
        wrong = 0
        with self._on_stream():
            for at, want, count in self._expected(xp):
                mine = got[at * item : (at + count) * item]
                if self.gpu is None:
                    wrong += int((mine.reshape(count, item) != want.reshape(count, item)).any(axis=1).sum())
                elif count:  # one mpigpu kernel for every size: no CuPy reduction compiled per size
                    wrong += count_changed_device(mine.data.ptr, want.data.ptr, count, item, self.gpu, self.stream)
        return wrong

    def _expected(self, xp: Any) -> list[tuple[int, Any, int]]:
        """(first element, expected bytes, elements) of each block of this rank's output."""
        nbytes, share, item = self.count * self.dtype.itemsize, self.splits[self.rank], self.dtype.itemsize
        start = sum(self.splits[: self.rank])
        if self.collective == "broadcast":
            return [(0, _pattern(xp, nbytes, ROOT, self.salt), self.count)]
        if self.collective == "allgather":
            return [(r * self.count, _pattern(xp, nbytes, r, self.salt), self.count) for r in range(self.nranks)]
        if self.collective == "alltoall":
            return [
                (r * share, _pattern(xp, nbytes, r, self.salt)[start * item : (start + share) * item], share)
                for r in range(self.nranks)
            ]
        total = sum(_values(xp, self.count, r, self.salt).astype(xp.int64) for r in range(self.nranks))
        return [(0, total[start : start + share].astype(self.dtype.np).view(xp.uint8), share)]

    def _on_stream(self) -> Any:
        import contextlib

        return contextlib.nullcontext() if self.gpu is None else self.stream

    def free(self) -> None:
        self.arenas.x = self.arenas.out = None
        self.x = self.out = self.result = None  # type: ignore[assignment]


def _values(xp: Any, count: int, rank: int, salt: int) -> Any:
    """Rank ``rank``'s reduce_scatter input for check ``salt``: small integers (0 to 7), int64."""
    return (xp.arange(count, dtype=xp.int64) % 251 + 3 * rank + salt) % 8


def _xp(gpu: Any) -> Any:
    if gpu is None:
        return np
    from mpigpu.core._cuda import cupy

    return cupy()


# -- the calls --------------------------------------------------------------------------------------
def bind_collective(
    path: Any, work: CollectiveWorkload, *, framework: str, ctx: Any, stream: Any = None, anchor: Any = None
) -> Any:
    """The call of ``path`` on ``work`` as a ``bench_calls.Bound`` (collective: a refusal raises the
    same InvalidArgument on every rank)."""
    import mpigpu
    from mpigpu.bench.anchors import _agreed_problem
    from mpigpu.bench.calls import Bound, _check_current_stream, _nothing, user_arrays
    from mpigpu.core.errors import MpigpuError
    from mpigpu.core.ops import Op
    from mpigpu.runtime.plan import choose_cached

    if path.kind == "anchor":
        if work.collective == "broadcast":
            return Bound(partial(anchor.broadcast, work.x, ROOT), _nothing)
        move = {
            "allgather": lambda: anchor.allgather(work.x, work.out),
            "reduce_scatter": lambda: anchor.reduce_scatter(work.x, work.out, work.splits),
            "alltoall": lambda: anchor.alltoall(work.x, work.out, work.splits),
        }[work.collective]
        return Bound(partial(_store, work, lambda: move() or work.out), _nothing)
    problem, choice = None, None
    try:
        x, _ = user_arrays(work, framework)  # type: ignore[arg-type]
        view = as_view(x)
        if work.collective == "alltoall":  # chosen as the call chooses: without the first dimension
            view = ArrayView(None, 0, (0,), view.dtype, view.device, False, view.framework)
        if work.collective == "reduce_scatter":  # as the call chooses (mpigpu.calls.reduce)
            choice = scatter_choice(ctx, view, Op.SUM, path.name)
        else:
            choice = choose_cached(ctx, view, Op.SUM, path.name, work.collective)
    except MpigpuError as exc:
        problem = str(exc)
    problem = _agreed_problem(ctx, problem)
    if problem is not None:
        raise InvalidArgument(problem)
    assert choice is not None
    if stream is not None:
        _check_current_stream(framework, work, stream)  # type: ignore[arg-type]
    kwargs = {} if path.name == "auto" else {"backend": path.name}  # auto is the default: left out
    if work.collective == "broadcast":
        work.result = x
        return Bound(partial(mpigpu.broadcast, x, ROOT, **kwargs), _nothing, choice.backend, choice.reason)
    if work.collective == "reduce_scatter":  # as a torch user writes it: into an output made once
        out = user_arrays(work, framework)[1]
        call = partial(mpigpu.reduce_scatter, x, "sum", out=out, **kwargs)
    else:
        splits = None if len(set(work.splits)) == 1 else work.splits  # an even split: none given, as torch's
        if path.call == "out":  # into an output made once, as torch's all_gather_into_tensor/all_to_all_single
            out = user_arrays(work, framework)[1]
            kwargs["out"] = out
        call = {
            "allgather": partial(mpigpu.allgather, x, **kwargs),
            "alltoall": partial(mpigpu.alltoall, x, splits, **kwargs),
        }[work.collective]
        if path.call == "out":
            return Bound(partial(_store_into, work, call, out), _nothing, choice.backend, choice.reason)
    return Bound(partial(_store, work, call), _nothing, choice.backend, choice.reason)


def _store(work: CollectiveWorkload, call: Any) -> None:
    work.result = call()


def _store_into(work: CollectiveWorkload, call: Any, out: Any) -> None:
    """The call with out=: what is checked is ``out`` itself, whatever the call returns."""
    call()
    work.result = out
