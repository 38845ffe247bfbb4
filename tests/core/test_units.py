"""Unit tests that need no MPI: dtypes, ops, settings, patterns, the verifier, array views, plans."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from semantics import combine_into

from mpigpu.core.arrays import as_view, check_out
from mpigpu.core.config import Settings, parse_count
from mpigpu.core.dtypes import DTYPES, parse_dtype
from mpigpu.core.errors import ConfigError, InvalidArgument
from mpigpu.core.ops import Op, finish_avg, parse_op
from mpigpu.core.patterns import rank_values
from mpigpu.core.verify import count_wrong_host, reference

FLOATS = ["float16", "bfloat16", "float32", "float64"]


# -- dtypes and ops ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("bf16", "bfloat16"),
        ("fp16", "float16"),
        ("float", "float32"),
        ("double", "float64"),
        ("int8", "int8"),
        ("UINT64", "uint64"),
    ],
)
def test_parse_dtype_names(text: str, name: str) -> None:
    assert parse_dtype(text).name == name


def test_parse_dtype_numpy_and_bfloat16() -> None:
    assert parse_dtype(np.dtype(np.float16)).name == "float16"
    assert parse_dtype(np.dtype(ml_dtypes.bfloat16)).name == "bfloat16"
    assert parse_dtype("torch.bfloat16").name == "bfloat16"


@pytest.mark.parametrize("bad", [np.complex64, np.bool_, object, "str", "complex128"])
def test_unsupported_dtypes_are_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="unsupported dtype"):
        parse_dtype(bad)


def test_parse_op() -> None:
    assert parse_op("AVG") is Op.AVG
    assert [o.index for o in Op] == [0, 1, 2, 3, 4]
    with pytest.raises(InvalidArgument, match="unknown op 'mean'"):
        parse_op("mean")


def test_integer_avg_truncates_toward_zero_and_wraps() -> None:
    acc = np.array([-128, -7, 7, 127, -1], dtype=np.int8)
    out = np.empty_like(acc)
    finish_avg(acc.copy(), 2, DTYPES["int8"], out)
    assert out.tolist() == [-64, -3, 3, 63, 0]
    big = np.array([2**64 - 1], dtype=np.uint64)
    out64 = np.empty_like(big)
    finish_avg(big.copy(), 3, DTYPES["uint64"], out64)
    assert int(out64[0]) == (2**64 - 1) // 3


def test_integer_sum_wraps_like_c() -> None:
    acc = np.array([100], dtype=np.int8)
    combine_into(Op.SUM, acc, np.array([100], dtype=np.int8))
    assert acc[0] == np.int8(-56)


# -- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [("1000", 1000), ("4K", 4096), ("1M", 1 << 20), ("64m", 64 << 20), ("2MiB", 2 << 20), ("1G", 1 << 30)],
)
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("bad", ["0", "-5", "1.5M", "lots", "", "4X"])
def test_parse_count_refuses(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_count(bad)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("MPIGPU_CUDA_AWARE", "maybe"),
        ("MPIGPU_NODE_SIZE", "0"),
        ("MPIGPU_NODE_SIZE", "two"),
        ("MPIGPU_TIMEOUT", "-1"),
        ("MPIGPU_TIMEOUT", "soon"),
        ("MPIGPU_CHECK", "2"),
        ("MPIGPU_HOST_POOL_MB", "x"),
    ],
)
def test_invalid_environment_values_are_errors(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        Settings.from_env()


def test_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MPIGPU_CUDA_AWARE", "MPIGPU_NODE_SIZE", "MPIGPU_TIMEOUT", "MPIGPU_STALL", "MPIGPU_CHECK"):
        monkeypatch.delenv(var, raising=False)
    s = Settings.from_env()
    assert s.cuda_aware is None and s.node_size is None and s.check
    # safe by default: a hang is reported after a minute and ends the job after 10 minutes
    assert s.stall == 60 and s.timeout == 600


# -- patterns and the verifier -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
def test_exact_pattern_reduces_exactly(dtype: str, op: Op, nranks: int) -> None:
    """The exact pattern's reduction, done in the dtype itself, equals the float64 reference."""
    d = DTYPES[dtype]
    index = np.arange(1000, dtype=np.int64)
    acc = rank_values("exact", op, d, 0, nranks, index).astype(d.acc.np)
    for r in range(1, nranks):
        combine_into(op, acc, rank_values("exact", op, d, r, nranks, index).astype(d.acc.np))
    got = np.empty(index.size, d.np)
    if op is Op.AVG:
        finish_avg(acc, nranks, d, got)
    else:
        got[...] = acc.astype(d.np)
    assert count_wrong_host(got, "exact", op, d, nranks) == 0
    ref, tol = reference("exact", op, d, nranks, index)
    exact = op is not Op.AVG or nranks & (nranks - 1) == 0 or not d.is_float
    if exact:
        assert np.all(tol == 0)
        assert np.array_equal(got.astype(np.float64), ref)
    assert np.any(ref != 0)  # never checked on zeros only


@pytest.mark.parametrize("dtype", FLOATS)
def test_seed_pattern_matches_sample_formula(dtype: str) -> None:
    d = DTYPES[dtype]
    index = np.arange(0, 1 << 20, 997, dtype=np.int64)
    values = rank_values("seed", Op.AVG, d, 3, 4, index).astype(np.float64)
    assert np.allclose(values, 3 + 0.001 * index, rtol=4 * d.eps)
    ref, _ = reference("seed", Op.AVG, d, 4, index)
    assert np.allclose(ref, 1.5 + 0.001 * index, rtol=8 * d.eps)  # (N-1)/2 + 0.001*i


@pytest.mark.parametrize("dtype", [*FLOATS, "int32", "uint8"])
def test_verifier_counts_poison_and_wrong_values(dtype: str) -> None:
    d = DTYPES[dtype]
    pattern = "seed" if d.is_float else "exact"
    index = np.arange(4096, dtype=np.int64)
    ref, _ = reference(pattern, Op.SUM, d, 4, index)
    got = ref.astype(d.np)
    assert count_wrong_host(got, pattern, Op.SUM, d, 4) == 0
    got.view(np.uint8)[: 3 * d.itemsize] = 0x7F  # poison three elements
    got[100] = got[100] + (1 if not d.is_float else got[100] * 0.25 + 1)
    assert count_wrong_host(got, pattern, Op.SUM, d, 4) == 4


def test_verifier_nan_is_wrong() -> None:
    got = reference("seed", Op.AVG, DTYPES["float32"], 2, np.arange(10))[0].astype(np.float32)
    got[5] = np.nan
    assert count_wrong_host(got, "seed", Op.AVG, DTYPES["float32"], 2) == 1


def test_seed_pattern_refuses_integers() -> None:
    with pytest.raises(InvalidArgument, match="--pattern exact"):
        rank_values("seed", Op.AVG, DTYPES["int32"], 0, 2, np.arange(3))


# -- array views ---------------------------------------------------------------------------------
def test_view_of_numpy_array() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    v = as_view(x)
    assert v.size == 12 and v.nbytes == 48 and v.device is None and v.dtype.name == "float32"
    assert v.host is not None and np.shares_memory(v.host, x)


def test_view_refuses_non_contiguous() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    with pytest.raises(InvalidArgument, match=r"not contiguous.*ascontiguousarray"):
        as_view(x)


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, "text", None])
def test_view_refuses_non_arrays(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="must be an array"):
        as_view(bad)


def test_view_refuses_unsupported_dtypes() -> None:
    for dtype in (np.complex64, np.bool_, object):
        with pytest.raises(InvalidArgument, match="unsupported dtype"):
            as_view(np.zeros(4, dtype=dtype))


def test_out_checks() -> None:
    x = as_view(np.zeros(8, np.float32))
    with pytest.raises(InvalidArgument, match="shape"):
        check_out(x, as_view(np.zeros(4, np.float32)))
    with pytest.raises(InvalidArgument, match="dtype"):
        check_out(x, as_view(np.zeros(8, np.float64)))
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        check_out(x, as_view(ro))
    base = np.zeros(12, np.float32)
    with pytest.raises(InvalidArgument, match="overlaps x only partly"):
        check_out(as_view(base[:8]), as_view(base[4:]))
    check_out(as_view(base[:8]), as_view(base[:8]))  # same memory = in place: allowed
