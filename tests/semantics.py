"""Inputs with NaN, signed zeros and integer extremes, and their exact expected results computed in
Python from mpigpu's semantics (mpigpu.core.ops): shared by the CPU tests and tests/gpu/."""

from __future__ import annotations

import math

import numpy as np

from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op, canonical_nan, minmax_rows

FLOAT_POOL = [math.nan, -math.nan, 0.0, -0.0, 1.0, -1.0, 2.0, 0.5, math.inf, -math.inf]
INT_POOL = [0, 1, -1, 2, -3, 5]
SIZES = range(1, 9)


def combine_into(op: Op, acc: np.ndarray, x: np.ndarray) -> None:
    """acc = acc (op) x, elementwise, in acc's dtype (integer overflow wraps; float min/max under
    mpigpu's semantics): a reduction one rank at a time, the reference the tests fold with."""
    if op in (Op.MIN, Op.MAX) and (acc.dtype.kind == "f" or acc.dtype == DTYPES["bfloat16"].np):
        minmax_rows([acc, x.astype(acc.dtype, copy=False)], op, acc)
        return
    with np.errstate(over="ignore", invalid="ignore"):
        op.ufunc(acc, x, out=acc, casting="unsafe")


def inputs(dtype: str, size: int, nranks: int, seed: int) -> np.ndarray:
    """nranks x size values, the same table on every rank (row r is rank r's input). Seed 0 is the
    issue's case: all 1.0 except all-NaN on the last rank; the others draw NaN (both signs), signed
    zeros and infinities at random positions and ranks. Sums and products of these are exact."""
    d = DTYPES[dtype]
    rng = np.random.default_rng(1000 * size + seed)
    if d.is_float:
        if seed == 0:
            table = np.ones((nranks, size))
            table[-1] = math.nan
        else:
            table = np.array(FLOAT_POOL)[rng.integers(0, len(FLOAT_POOL), (nranks, size))]
        out = np.empty((nranks, size), d.np)
        with np.errstate(invalid="ignore"):
            out[...] = table.astype(np.float32) if d.is_half else table
        return out
    pool = INT_POOL if d.np.kind == "i" else [abs(v) for v in INT_POOL]
    return np.array(pool, d.np)[rng.integers(0, len(pool), (nranks, size))]


def _key(v: float) -> tuple[float, float]:
    return (v, math.copysign(1.0, v))  # -0.0 sorts below +0.0


def expected(table: np.ndarray, op: Op, dtype: str) -> np.ndarray:
    """The exact result of reducing the rows of ``table`` with ``op`` (float NaN results: the
    canonical NaN; compare with ``problems``)."""
    d = DTYPES[dtype]
    n, size = table.shape
    if n == 1:
        return table[0].copy()  # one rank: allreduce is a copy, bit for bit (README), NaN bits kept
    out = np.empty(size, d.np)
    for i in range(size):
        if not d.is_float:
            col = [int(v) for v in table[:, i]]
            if op is Op.SUM or op is Op.AVG:
                value = sum(col)
                if op is Op.AVG:
                    value = abs(value) // n * (1 if value >= 0 else -1)  # truncation toward zero
            elif op is Op.PROD:
                value = math.prod(col)
            else:
                value = (max if op is Op.MAX else min)(col)
            info = np.iinfo(d.np)
            out[i] = (value - info.min) % (info.max - info.min + 1) + info.min  # sums wrap as in C
            continue
        col = [float(v) for v in table[:, i]]
        if op in (Op.MIN, Op.MAX):
            value = math.nan if any(map(math.isnan, col)) else (max if op is Op.MAX else min)(col, key=_key)
        elif op is Op.PROD:
            value = col[0]
            for v in col[1:]:
                value *= v
        else:
            value = col[0]
            for v in col[1:]:
                value += v
            if op is Op.AVG:
                value /= n
        with np.errstate(invalid="ignore", over="ignore"):
            out[i] = value
    if d.is_float:
        bits = out.view(f"u{d.itemsize}")
        bits[np.isnan(out.astype(np.float64))] = canonical_nan(d)
    return out


def problems(got: np.ndarray, want: np.ndarray, op: Op, dtype: str) -> list[str]:
    """Where ``got`` differs from ``want``: bit for bit, except that a float NaN from sum, avg or
    prod may be any NaN (whose bits the identity check compares across ranks)."""
    d = DTYPES[dtype]
    bits = f"u{d.itemsize}"
    g, w = got.reshape(-1).view(bits), want.view(bits)
    found = []
    for i in range(want.size):
        if g[i] == w[i]:
            continue
        nan_both = math.isnan(float(got.reshape(-1)[i])) and math.isnan(float(want[i]))
        if d.is_float and op not in (Op.MIN, Op.MAX) and nan_both:
            continue
        found.append(f"[{i}] got {got.reshape(-1)[i]!r} ({int(g[i]):#x}), want {want[i]!r} ({int(w[i]):#x})")
    return found


def int_extremes(dtype: str, nranks: int, rank: int) -> list[tuple[str, int]]:
    """(case, this rank's value) for integer avg: the extremes, identical values, mixed signs."""
    info = np.iinfo(DTYPES[dtype].np)
    lo, hi = int(info.min), int(info.max)
    cases = [
        ("all min", lo),
        ("all max", hi),
        ("all min+1", lo + 1),
        ("max and min alternating", hi if rank % 2 else lo),
        ("min and max alternating", lo if rank % 2 else hi),
        ("max - rank", hi - rank),
        ("min + rank", lo + rank),
        ("2**(bits-1 or -2) + rank", (hi + 1) // 2 + rank),
        ("-1 and 0", -(rank % 2) if lo < 0 else rank % 2),
        ("rank - n//2 (mixed signs)", rank - nranks // 2 if lo < 0 else rank),
    ]
    return [(name, max(lo, min(hi, v))) for name, v in cases]


def trunc_mean(values: list[int]) -> int:
    s = sum(values)
    return abs(s) // len(values) * (1 if s >= 0 else -1)
