"""The verifier: a float64 (int64 for integers) reference of what every element must be, and the
number of wrong elements, summed over ranks.

Tolerances: the exact pattern is checked exactly (avg over a rank count that is not a power of
two: within one unit in the last place, since NCCL averages by pre-multiplying with 1/n). The seed
pattern's sums round: |got - ref| <= (n + 1) * eps(dtype) * sum_r |x_r|, which admits any
summation order and per-step rounding in the dtype (NCCL's float16), and nothing grossly wrong.
min and max never round and are always exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpigpu.core.dtypes import DType
from mpigpu.core.ops import Op
from mpigpu.core.patterns import rank_values

__all__ = ["count_wrong_host", "reference", "total_wrong"]

_CHUNK = 1 << 20


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def reference(pattern: str, op: Op, dtype: DType, nranks: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(expected value, allowed absolute error) at global indices ``index``, both float64.

    For integer dtypes the expected values are exact integers (wrapped like the dtype)."""
    if not dtype.is_float:
        acc = rank_values(pattern, op, dtype, 0, nranks, index).astype(np.int64)
        with np.errstate(over="ignore"):
            for r in range(1, nranks):
                x = rank_values(pattern, op, dtype, r, nranks, index).astype(np.int64)
                if op.base is Op.SUM:
                    acc += x
                elif op is Op.MIN:
                    np.minimum(acc, x, out=acc)
                elif op is Op.MAX:
                    np.maximum(acc, x, out=acc)
                else:
                    acc *= x
        wrapped = acc.astype(dtype.np)  # two's-complement wrap, like C and MPI
        if op is Op.AVG:
            wide = wrapped.astype(np.int64) if dtype.np.kind == "i" else wrapped.astype(np.uint64)
            quotient = (wide - np.fmod(wide, wide.dtype.type(nranks))) // wide.dtype.type(nranks)
            wrapped = quotient.astype(dtype.np)
        return wrapped.astype(np.float64), np.zeros(index.size)

    values = [rank_values(pattern, op, dtype, r, nranks, index).astype(np.float64) for r in range(nranks)]
    stacked = np.stack(values)
    with np.errstate(over="ignore", invalid="ignore"):
        if op.base is Op.SUM:
            ref = stacked.sum(axis=0)
            magnitude = np.abs(stacked).sum(axis=0)
        elif op is Op.MIN:
            ref, magnitude = stacked.min(axis=0), np.zeros(index.size)
        elif op is Op.MAX:
            ref, magnitude = stacked.max(axis=0), np.zeros(index.size)
        else:
            ref = np.prod(stacked, axis=0)
            magnitude = np.abs(ref)
        if op is Op.AVG:
            ref = ref / nranks
            magnitude = magnitude / nranks
    eps = dtype.eps
    if pattern == "exact":
        if op is Op.AVG and not _is_pow2(nranks):
            return ref, eps * np.abs(ref)
        return ref, np.zeros(index.size)
    if op in (Op.MIN, Op.MAX):
        return ref, np.zeros(index.size)
    return ref, (nranks + 1) * eps * magnitude


def count_wrong_host(got: np.ndarray, pattern: str, op: Op, dtype: DType, nranks: int, offset: int = 0) -> int:
    """Wrong elements in this rank's 1-D host result (NaN is wrong unless expected)."""
    wrong = 0
    flat = got.reshape(-1)
    for start in range(0, flat.size, _CHUNK):
        stop = min(flat.size, start + _CHUNK)
        index = np.arange(offset + start, offset + stop, dtype=np.int64)
        ref, tol = reference(pattern, op, dtype, nranks, index)
        value = flat[start:stop].astype(np.float64)
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(value - ref) <= tol)
            bad &= ~(np.isnan(value) & np.isnan(ref))
            bad &= ~((value == ref) & np.isinf(ref))
        wrong += int(bad.sum())
    return wrong


def total_wrong(comm: Any, wrong: int) -> int:
    """Sum of wrong-element counts over all ranks."""
    from mpigpu.core._mpi import MPI

    return int(comm.allreduce(int(wrong), op=MPI().SUM))
