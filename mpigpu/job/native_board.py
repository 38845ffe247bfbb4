"""The check boards' compiled exchange (native_board.c): a check, or a tiny host allreduce, in one C call.

A check on a board is a few steps (post, wait, exchange among nodes, compare) and a tiny allreduce adds
the reduction of every rank's row; in Python those steps cost a tiny call ~3-4 us of its own, more than
MPI_Allreduce itself at 2 ranks. native_board.c runs the same steps on the same memory in one ctypes call
(the GIL released, so the watchdog still ends a job whose rank never arrives). Nothing about the boards
changes: the layout, the check numbers, the results' bits (the fold adds in rank order, as
mpigpu.backends.cpu_board does), so a rank on the compiled path and a rank on the Python path pair.

Each board describes itself once, per parity, as a ``Plan``: where this rank posts, which words it
waits on, the exchange among nodes (MPI_Allgather or MPI_Allgatherv through mpi4py's MPI library, with
its handles) and where every rank's row lies. ``compiled(board_plans)`` gives the board its ``Native``, or
None where the helper is not here: no C compiler, a failed build, the cache refused (then the Python path
runs; ``why_not()`` says why), or MPIGPU_BOARD_HANDLER=python.

Build: the C compiler (``CC``, else ``cc``/``gcc``/``clang``), once per machine, into the private kernel
cache (mpigpu.core.build_cache), loaded from the verified bytes (mpigpu.core.native).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mpigpu.core import native
from mpigpu.core._mpi import MPI
from mpigpu.core.config import settings
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.job.shm import SPIN_S

__all__ = ["FOLD_OPS", "Exchange", "Fold", "Native", "Plan", "compiled", "exchange_functions", "plan", "why_not"]

SOURCE = "native_board.c"
_MAGIC = b"mpigpu-board-so-1\n"
_SUBDIR = "board"
_FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")
_ALLGATHER, _ALLGATHERV = 1, 2  # native_board.c's exchanges (0: none, a Plan's default)
_UNKNOWN_FOLD = -1000000
# native_board.c's op codes; its dtypes are mpigpu.core.dtypes' codes: every type but the half ones
FOLD_OPS = {Op.SUM: 0, Op.PROD: 1, Op.MIN: 2, Op.MAX: 3, Op.AVG: 4}
_FOLD_DTYPES = frozenset(d.code for d in DTYPES.values() if not d.is_half)
_FLOAT_DTYPES = frozenset(d.code for d in DTYPES.values() if d.is_float and not d.is_half)
_P = ctypes.c_void_p


class Plan(ctypes.Structure):
    """One parity of one board: native_board.c's ``Plan``, field for field."""

    _fields_ = [
        ("post_k", _P), ("post", _P), ("waits", _P), ("nwaits", ctypes.c_int32), ("exchange", ctypes.c_int32),
        ("handle_bytes", ctypes.c_int32), ("nranks", ctypes.c_int32), ("fn", _P), ("send", _P), ("recv", _P),
        ("count", ctypes.c_int64), ("counts", _P), ("displs", _P), ("byte_type", ctypes.c_int64),
        ("comm", ctypes.c_int64), ("publish", _P), ("rows", _P), ("spin_ns", ctypes.c_int64),
    ]  # fmt: skip


class Fold(ctypes.Structure):
    """A fused allreduce's reduction: native_board.c's ``Fold``."""

    _fields_ = [("dtype", ctypes.c_int32), ("op", ctypes.c_int32), ("count", ctypes.c_int64), ("result", _P)]


@dataclass(frozen=True)
class Exchange:
    """The exchange among nodes of one parity: MPI_Allgather (``counts`` None) or MPI_Allgatherv of
    ``count`` bytes per member from ``send`` (an address, or MPI_IN_PLACE's value) into ``recv``."""

    comm: Any
    send: int
    recv: int
    count: int
    counts: Sequence[int] | None = None


_lock = threading.Lock()
_state: list[Callable[..., int] | str] = []  # the loaded call, or why there is none (once per process)


def _load() -> Callable[..., int]:
    data, _ = native.build_library("c", "mpigpu.job", SOURCE, _FLAGS, stem="board", subdir=_SUBDIR, magic=_MAGIC,
                                   what="compiled-board cache")  # fmt: skip
    dll = native.load_from_memory(data, "mpigpu-board")
    for symbol, struct in (("mpigpu_board_plan_bytes", Plan), ("mpigpu_board_fold_bytes", Fold)):
        function = getattr(dll, symbol)
        function.restype = ctypes.c_int64
        if function() != ctypes.sizeof(struct):
            raise native.BuildFailed(f"its {struct.__name__} layout differs from this module's")
    call = dll.mpigpu_board_call
    call.restype = ctypes.c_int
    call.argtypes = (_P, ctypes.c_int64, ctypes.c_char_p, _P)
    return call  # type: ignore[no-any-return]


def _function() -> Callable[..., int] | str:
    with _lock:
        if not _state:
            try:
                _state.append(_load())
            except (native.BuildFailed, OSError, AttributeError) as exc:
                _state.append(f"the compiled board is not available ({exc}); using the Python path")
        return _state[0]


def why_not(exchanges: bool = False) -> str | None:
    """Why boards (``exchanges``: those that exchange among nodes) run their Python path in this process
    (None: they run the compiled one). Builds or loads the helper on its first call."""
    if settings().board_handler == "python":
        return "MPIGPU_BOARD_HANDLER=python"
    found = _function()
    if isinstance(found, str):
        return found
    functions = exchange_functions() if exchanges else None
    return f"no MPI functions for the exchange among nodes: {functions}" if isinstance(functions, str) else None


@functools.cache
def exchange_functions() -> dict[str, int] | str:
    """MPI_Allgather's and MPI_Allgatherv's addresses in mpi4py's MPI library, or why not (none found, or
    several: a libmpi.so* beside the standard-ABI libmpi_abi.so*, whose handles mpi4py may be using).
    Found once per process, as core.native.library_functions finds its functions."""
    if native.loaded_libraries("libmpi_abi.so"):
        return "MPI's standard-ABI library (libmpi_abi.so) is loaded: which MPI mpi4py calls is not told here"
    return native.library_functions("libmpi.so", {"allgather": "MPI_Allgather", "allgatherv": "MPI_Allgatherv"})


def _addresses(values: Sequence[int]) -> ctypes.Array[Any]:
    return (_P * max(1, len(values)))(*values)


def plan(post: int, post_k: int | None, waits: Sequence[int], rows: Sequence[int], exchange: Exchange | None = None,
         publish: int | None = None, spin_s: float = SPIN_S) -> tuple[Plan, list[Any]]:  # fmt: skip
    """A parity's Plan from addresses (``post``: this rank's slot; ``post_k``: its check-number word;
    ``waits``: words awaited before the exchange; ``rows``: every rank's slot in rank order; ``publish``:
    where a leader publishes k; ``spin_s``: how long a wait spins before it yields, the board's Python
    path's), and what it points into (kept alive beside it)."""
    wait_array, row_array = _addresses(waits), _addresses(rows)
    keep: list[Any] = [wait_array, row_array]
    p = Plan(post_k=post_k, post=post, waits=ctypes.addressof(wait_array), nwaits=len(waits), nranks=len(rows),
             publish=publish, rows=ctypes.addressof(row_array), spin_ns=round(spin_s * 1e9))  # fmt: skip
    if exchange is not None:
        mpi = MPI()
        functions = exchange_functions()
        assert not isinstance(functions, str), "compiled() checks the MPI functions first"
        p.exchange = _ALLGATHER if exchange.counts is None else _ALLGATHERV
        p.handle_bytes = mpi._sizeof(mpi.Comm)
        p.fn = functions["allgather" if exchange.counts is None else "allgatherv"]
        p.send, p.recv, p.count = exchange.send & (2**64 - 1), exchange.recv, exchange.count
        p.byte_type, p.comm = mpi._handleof(mpi.BYTE), mpi._handleof(exchange.comm)
        if exchange.counts is not None:
            n = len(exchange.counts)
            counts = (ctypes.c_int32 * n)(*exchange.counts)
            displs = (ctypes.c_int32 * n)(*(sum(exchange.counts[:j]) for j in range(n)))
            p.counts, p.displs = ctypes.addressof(counts), ctypes.addressof(displs)
            keep += [counts, displs]
    return p, keep


class Native:
    """A board's compiled exchange: its two parities' plans (and what they point into)."""

    def __init__(self, call: Callable[..., int], plans: Sequence[tuple[Plan, list[Any]]]) -> None:
        self.call = call  # call(addresses[k & 1], k, packed, fold): native_board.c's answer (``verdict``)
        self._keep = plans  # what the plans point into
        self.plans = tuple(p for p, _ in plans)
        self.addresses = tuple(ctypes.addressof(p) for p in self.plans)

    def run(self, k: int, packed: bytes, fold: int | None = None) -> bool:
        """Check ``k`` of ``packed`` (and, with ``fold``, a Fold's address, the reduction into its result):
        True where every rank posted ``packed``. Collective, as the board's Python check."""
        return self.verdict(self.call(self.addresses[k & 1], k, packed, fold))

    @staticmethod
    def verdict(rc: int) -> bool:
        """native_board.c's answer: True (1) where every rank posted the same values, False (0) where not;
        an MPI error code (negated) or an unknown fold raises."""
        if rc >= 0:
            return rc == 1
        if rc == _UNKNOWN_FOLD:
            raise ValueError("the compiled board was given a fold of a dtype it does not reduce")
        raise MPI().Exception(-rc)

    @staticmethod
    def fold(dtype_code: int, op: Op, count: int, result: int) -> Fold:
        """The Fold of a fused allreduce of ``count`` elements into the address ``result``."""
        is_float = dtype_code in _FLOAT_DTYPES
        plain = op in (Op.SUM, Op.PROD, Op.AVG) if is_float else op in (Op.SUM, Op.PROD, Op.MIN, Op.MAX)
        if dtype_code not in _FOLD_DTYPES or not plain:  # float min/max, integer avg: never on the board
            raise ValueError(f"the compiled board does not reduce dtype code {dtype_code} with {op}")
        return Fold(dtype=dtype_code, op=FOLD_OPS[op], count=count, result=result)


def compiled(make_plans: Callable[[], Sequence[tuple[Plan, list[Any]]]], *, exchanges: bool = False) -> Native | None:
    """A board's Native from ``make_plans`` (its two parities' plans), or None where boards run their
    Python path here (``why_not``), or the board exchanges among nodes (``exchanges``) and MPI's
    functions cannot be found in this process. Local: the ranks need not agree (the two paths pair)."""
    if why_not(exchanges) is not None:
        return None
    call = _function()
    assert not isinstance(call, str)
    return Native(call, make_plans())
