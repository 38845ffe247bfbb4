"""One rank's own CPU time in a tiny ``mpigpu.allreduce`` on the node check board at N ranks, measured
in one process: no other rank, no waiting, so N ranks need not have N cores.

    python scripts/board_call_cost.py --ranks 8,16
    python scripts/board_call_cost.py --ranks 8 --profile        # and cProfile's top functions

The process starts mpigpu alone (one rank), then poses as rank 0 of N ranks on one node: its context's
size is set to N and its check board is a CheckBoard over a private buffer of N ranks' slots, the other
ranks' rows holding 1.0. Before each check the other ranks' posts (their values and check number) are
written as they would arrive; that writing is timed alone and subtracted. What is left is what this
rank runs per call on the fused path (mpigpu.backends.cpu_board): the lookup of the call's record, the
post, the comparison of every rank's signature, the reduction of every rank's row and the NaN rule; in
the board's compiled helper (mpigpu.job.native_board), or in Python under MPIGPU_BOARD_HANDLER=python.
Float32, sum, in place; each figure is the best of 7 batches of ``--calls`` calls, in microseconds.
The synchronisation between real ranks (the wait for the last post) is not in it: scripts/call_cost.py
measures that (its "check alone" row) under mpiexec.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import timeit
from types import SimpleNamespace
from typing import Any

import numpy as np

import mpigpu
from mpigpu.job import check_board
from mpigpu.runtime.context import Context


class _Posed(check_board.CheckBoard):
    """A CheckBoard of ``n`` ranks seen from rank 0, over a private buffer (no shared segment, no MPI)."""

    def __init__(self, comm: Any, n: int) -> None:  # the attributes CheckBoard.__init__ sets, for n ranks
        slot = check_board._SLOT
        self.comm, self.size, self.rank, self.k = comm, n, 0, 0
        array = np.zeros(2 * slot * 8 * n, np.uint8)
        self._segment = SimpleNamespace(array=array)  # type: ignore[assignment]
        self._bytes = memoryview(array)
        self._mv = self._bytes.cast("q")
        self._fence = None
        self._mine = (0, slot)
        self._all = tuple(tuple(2 * slot * r + p * slot for r in range(n)) for p in (0, 1))
        self._my_values = tuple(self._bytes[8 * m + 8 : 8 * m + 8 + check_board._VALUES] for m in self._mine)
        self._others = tuple(
            tuple((s, self._bytes[8 * s + 8 : 8 * s + 8 + check_board._VALUES]) for s in slots[1:])
            for slots in self._all
        )
        self.native = check_board.compiled(self._plans)  # the compiled exchange, unless MPIGPU_BOARD_HANDLER=python

    def others_post(self, packed: bytes) -> None:
        """Every other rank's post of the next check: its values, then its check number."""
        k = self.k + 1
        for slot, values in self._others[k & 1]:
            values[:] = packed
            self._mv[slot] = k

    def agree_packed(self, packed: bytes) -> bool:
        self.others_post(packed)
        return super().agree_packed(packed)

    def agree_folding(self, packed: bytes, data: Any, rows: Any, fold: int) -> bool:
        self.others_post(packed)
        return super().agree_folding(packed, data, rows, fold)


def _best_us(f: Any, calls: int) -> float:
    return min(timeit.repeat(f, number=calls, repeat=7)) / calls * 1e6


def measure(n: int, calls: int, profile: bool) -> None:
    x = np.ones(2, np.float32)
    mpigpu.allreduce(x, "sum")  # the context, made for one rank
    ctx = Context.get()
    ctx.size = n
    ctx.check_board = board = _Posed(ctx.comm, n)
    ctx.plan_cache.clear()  # the one-rank record forgotten: the next call is bound for n ranks
    for parity in board.rows(np.dtype(np.float32), x.shape):
        for row in parity[1:]:
            row[...] = 1.0
    mpigpu.allreduce(x, "sum")
    if x[0] != n:
        raise SystemExit(f"the posed call gave {x[0]}, not {n}: not the board's fused path")
    record = next(v for v in ctx.plan_cache.values() if getattr(v, "fused", None) is not None)
    x[:] = 0.0  # each call adds n - 1 to x: exact and finite for every batch here
    call = lambda: mpigpu.allreduce(x, "sum")  # noqa: E731
    whole, posts = _best_us(call, calls), _best_us(lambda: board.others_post(record.packed), calls)
    print(f"{n} ranks: whole call {whole:.2f} us, others' posts {posts:.2f} us, this rank's own {whole - posts:.2f} us")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            call()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    ctx.size, ctx.check_board = 1, None
    ctx.plan_cache.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{sys.executable} scripts/board_call_cost.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--ranks", default="8,16", help="rank counts to pose as, comma-separated")
    parser.add_argument("--calls", type=int, default=20000, help="calls per batch")
    parser.add_argument("--profile", action="store_true", help="also cProfile's top functions per rank count")
    args = parser.parse_args(argv)
    for n in (int(t) for t in args.ranks.split(",")):
        measure(n, args.calls, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
