"""The tiny allreduce's reduction of the board's rows (mpigpu/backends/cpu_board.py), without MPI: at
3 to 32 ranks, for every row shape the board holds, the result is bitwise that of adding (or
multiplying) the rows one after another in rank order in the dtype, whether it takes the one-call
reduction over the stacked slots or the loop of calls (one element a row, two ranks); signed zeros
included. Integer min and max reduce by the stacked slots too."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from mpigpu.backends import cpu_board
from mpigpu.backends.cpu_board import _stacks, bind_board_allreduce, quietly
from mpigpu.core.arrays import as_view
from mpigpu.core.ops import Op
from mpigpu.job.check import Signature
from mpigpu.job.check_board import DATA_BYTES, SLOT_BYTES, BoardPosts, CheckBoard
from mpigpu.job.mpi_board import MpiBoard
from mpigpu.job.native_board import compiled, plan, why_not


@pytest.fixture(autouse=True)
def _boards_made_on_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The boards here are made over a communicator of the test's own (no MPI): none gets the compiled
    exchange by itself; the tests that run it give a board one without an exchange (``_compile``)."""
    monkeypatch.setenv("MPIGPU_BOARD_HANDLER", "python")


def _compile(board: Any, slots: list[list[int]], packed: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give ``board`` the compiled exchange over its own slots (per parity, every rank's address; rank 0
    posts, nothing waits, nothing is exchanged), every slot holding ``packed`` (every rank agrees)."""
    monkeypatch.setenv("MPIGPU_BOARD_HANDLER", "auto")
    if why_not() is not None:
        pytest.skip(f"the compiled board is not here: {why_not()}")
    for parity in slots:
        for address in parity:
            (ctypes.c_char * len(packed)).from_address(address + 8)[:] = packed
    board.native = compiled(lambda: [plan(parity[0], None, [], parity) for parity in slots])
    assert board.native is not None
    monkeypatch.setenv("MPIGPU_BOARD_HANDLER", "python")  # the next board made here: as the others


class _Ranks:
    """A communicator of ``n`` ranks seen from rank 0 whose Allgather leaves the slots as they are:
    the test writes every rank's slot itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def Get_size(self) -> int:
        return self.n

    def Get_rank(self) -> int:
        return 0

    def Allgather(self, send: Any, recv: Any) -> None:
        return None


class _NodeLayout(BoardPosts):
    """The node board's rows (CheckBoard.rows: each rank's two parity slots side by side, so a rank's
    row of one parity is two slots after the previous rank's) seen from rank 0, whose every post is
    agreed at once: the test writes every other rank's row itself. The posting around the check is the
    boards' own (BoardPosts)."""

    rows = CheckBoard.rows
    native: Any = None

    def __init__(self, n: int) -> None:
        self.size, self.rank, self.k = n, 0, 0
        self._segment = SimpleNamespace(array=np.zeros(2 * SLOT_BYTES * n, np.uint8))
        self._all = tuple(tuple((2 * r + p) * SLOT_BYTES // 8 for r in range(n)) for p in (0, 1))

    def agree_packed(self, packed: bytes) -> bool:
        self.k += 1
        return True

    def slots(self) -> list[list[int]]:
        base = self._segment.array.ctypes.data
        return [[base + 8 * slot for slot in parity] for parity in self._all]


SHAPES = [(1,), (2,), (5,), (11,), (44,), (2, 3), (5, 1), (1, 5), (4, 11)]


def _buffer_slots(board: MpiBoard) -> list[list[int]]:
    return [[b.ctypes.data + SLOT_BYTES * r for r in range(board.size)] for b in board._buffers]


@pytest.mark.parametrize("handler", ["python", "compiled"])
@pytest.mark.parametrize("n", [2, 3, 4, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", [Op.SUM, Op.PROD, Op.AVG])
def test_the_rows_are_combined_in_rank_order_bit_for_bit(n: int, dtype: str, op: Op, handler: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    rng = np.random.default_rng(n)
    for shape in SHAPES:
        x = np.zeros(shape, dtype)
        if x.nbytes > DATA_BYTES:
            continue
        board = MpiBoard(_Ranks(n))
        sig = Signature(x.size, 1, op.code, 1, 0, shape=shape)
        packed = sig.packed()
        if handler == "compiled":
            _compile(board, _buffer_slots(board), packed, monkeypatch)
        launch = bind_board_allreduce(board, None, as_view(x), op, sig, packed)
        for step in range(4):  # both parities, twice
            scale = 10.0 ** rng.integers(-6, 7, size=(n, *shape)) if op is not Op.PROD else 1.0
            values = (rng.standard_normal((n, *shape)) * scale).astype(dtype)
            values.reshape(n, -1)[:, 0] = -0.0  # signed zeros: -0.0 + -0.0 stays -0.0, -0.0 * x keeps its sign
            values.reshape(n, -1)[n // 2, -1] = 0.0
            for parity_rows in board.rows(np.dtype(dtype), shape):
                for r in range(n):
                    parity_rows[r][...] = values[r]
            for buffer in board._buffers:  # every rank posted the same signature
                for r in range(n):
                    buffer[256 * r + 8 : 256 * r + 80] = np.frombuffer(packed, np.uint8)
            want = values[0].copy()
            for r in range(1, n):
                (np.multiply if op is Op.PROD else np.add)(want, values[r], out=want)
            if op is Op.AVG:
                np.divide(want, want.dtype.type(n), out=want)  # one IEEE division of the rank-order sum
            out = np.full(shape, np.nan, dtype)
            launch(None, values[0], out)
            assert out.tobytes() == want.tobytes(), (n, dtype, op, shape, step)


@pytest.mark.parametrize("handler", ["python", "compiled"])
@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("op", [Op.SUM, Op.PROD, Op.MIN, Op.MAX])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"])
def test_integer_rows_reduce_exactly_and_wrap_as_numpy(n: int, op: Op, dtype: str, handler: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Every integer type: sums and products wrap modulo 2**bits, as NumPy's (and MPI's) do; min and max
    in the type's order."""
    rng = np.random.default_rng(7)
    shape = (6,)
    board = MpiBoard(_Ranks(n))
    sig = Signature(6, 3, op.code, 1, 0, shape=shape)
    packed = sig.packed()
    x = np.zeros(shape, dtype)
    if handler == "compiled":
        _compile(board, _buffer_slots(board), packed, monkeypatch)
    launch = bind_board_allreduce(board, None, as_view(x), op, sig, packed)
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max, size=(n, *shape), dtype=dtype, endpoint=True)
    values[:, 0] = np.arange(5, 5 + n)  # all positive: min is not 0
    values[:, 1] = info.max  # sums and products that wrap
    for parity_rows in board.rows(np.dtype(dtype), shape):
        for r in range(n):
            parity_rows[r][...] = values[r]
    for buffer in board._buffers:
        for r in range(n):
            buffer[256 * r + 8 : 256 * r + 80] = np.frombuffer(packed, np.uint8)
    out = np.full(shape, 1, dtype)
    launch(None, values[0], out)
    want = values[0].copy()
    with np.errstate(over="ignore"):
        for r in range(1, n):
            op.ufunc(want, values[r], out=want)
    assert out.tobytes() == want.tobytes(), (op, out, want)


@pytest.mark.filterwarnings("error")  # overflow and inf - inf: IEEE results, never a warning
@pytest.mark.parametrize("handler", ["python", "compiled"])
@pytest.mark.parametrize("n", [3, 8, 16])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_node_boards_rows_reduce_in_one_call_in_rank_order(n: int, dtype: str, handler: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The node board's rows, two slots apart, take the one-call reduction too (at 8 ranks it replaced
    seven ufunc calls), with the rank-order loop's bits, signed zeros, infinities and NaN included."""
    rng = np.random.default_rng(n)
    for shape in [(2,), (5,), (2, 3)]:
        board = _NodeLayout(n)
        rows = board.rows(np.dtype(dtype), shape)
        assert _stacks(rows, int(np.prod(shape)), True) is not None, "the node board's layout takes the loop"
        x = np.zeros(shape, dtype)
        sig = Signature(x.size, 1, Op.SUM.code, 1, 0, shape=shape)
        if handler == "compiled":
            _compile(board, board.slots(), sig.packed(), monkeypatch)
        launch = bind_board_allreduce(board, None, as_view(x), Op.SUM, sig, sig.packed())
        for step in range(4):  # both parities, twice
            values = (rng.standard_normal((n, *shape)) * 10.0 ** rng.integers(-6, 7, size=(n, *shape))).astype(dtype)
            values.reshape(n, -1)[:, 0] = -0.0  # -0.0 + -0.0 stays -0.0
            if step == 2:  # overflow: the rank-order sum's inf
                values.reshape(n, -1)[0, -1] = values.reshape(n, -1)[1, -1] = np.finfo(dtype).max
            if step == 3:
                values.reshape(n, -1)[1, -1] = np.inf  # a result's inf, then the canonical NaN of inf - inf
                values.reshape(n, -1)[2, -1] = -np.inf
            parity = rows[(board.k + 1) & 1]
            for r in range(1, n):
                parity[r][...] = values[r]
            want = values[0].copy()
            with np.errstate(over="ignore", invalid="ignore"):
                for r in range(1, n):
                    np.add(want, values[r], out=want)
            out = np.full(shape, 7.0, dtype)
            with np.errstate(all="raise"):  # a caller's settings change nothing: the same on every rank
                launch(None, values[0], out)
            if step == 3:
                assert np.isnan(out.reshape(-1)[-1])
                want.reshape(-1)[-1] = out.reshape(-1)[-1]  # the canonical NaN (checked bitwise elsewhere)
            assert out.tobytes() == want.tobytes(), (n, dtype, shape, step)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("context_errstate", [True, False])  # NumPy 2's context variable; NumPy 1's errstate
def test_quietly_silences_overflow_and_invalid_inside_only(
    monkeypatch: pytest.MonkeyPatch, context_errstate: bool
) -> None:
    monkeypatch.setattr(cpu_board, "_CONTEXT_ERRSTATE", context_errstate and cpu_board._CONTEXT_ERRSTATE)
    with np.errstate(all="raise"):  # a caller's settings: the reduction runs under its own all the same
        before = np.geterr()
        run = quietly()
        big = np.array([np.finfo(np.float32).max, np.inf], np.float32)
        out = np.empty(2, np.float32)
        for _ in range(2):  # entered again after leaving
            run(np.add, big, big * np.array([1, -1], np.float32), out=out)
            assert out[0] == np.inf and np.isnan(out[1])
        assert np.geterr() == before  # the caller's settings untouched
        tiny = np.array([np.finfo(np.float32).tiny], np.float32)
        run(np.multiply, tiny, tiny, out=out[:1])  # underflow: ignored inside too
        with pytest.raises(FloatingPointError):
            np.add(big, big, out=out)  # outside: the caller's "raise"
