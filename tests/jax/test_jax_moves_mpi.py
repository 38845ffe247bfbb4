"""mpigpu.jax.broadcast and mpigpu.jax.allgather on JAX CPU arrays under mpiexec (-n 1 to 4), issue 23:
inside jax.jit against the exact values every rank can compute, in one token chain with allreduce,
under jax.grad (the sums of the cotangents) and vmap, outside jit, and a root that differs across ranks
raising MismatchError on every rank while compiling."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (the CI test script installs it)")
jnp = jax.numpy

from mpigpu.core.errors import InvalidArgument, MismatchError  # noqa: E402

mpi = pytest.mark.mpi(min_size=1)
# float64 kept 64-bit, and the CPU programs carrying their token on GPU machines too (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jax_x64", "jax_cpu_programs_tokened")


DTYPES = ["float32", "float64", "bfloat16", "int32", "int64", "uint8"]


@pytest.fixture
def mj():
    import mpigpu.jax as mj

    mj.init()  # collective on the first call: every rank makes it here
    return mj


def _rows(rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Rank ``rank``'s exact input: small integers, distinct per rank and element."""
    count = int(np.prod(shape))
    return ((np.arange(count) * 7 + rank * 13) % 97).reshape(shape).astype(dtype if dtype != "bfloat16" else "f4")


def _put(x: np.ndarray, dtype: str):
    return jax.device_put(jnp.asarray(x, dtype=dtype), jax.devices("cpu")[0])


def _same_everywhere(comm, arr) -> None:
    digest = hashlib.sha256(np.asarray(arr).tobytes()).hexdigest()
    assert len(set(comm.allgather(digest))) == 1, "ranks hold different bits"


@mpi
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (5, 3)])
def test_broadcast_inside_jit(comm, mj, dtype: str, shape: tuple[int, ...]) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    root = size - 1
    out = jax.jit(lambda v: mj.broadcast(v, root))(_put(_rows(rank, shape, dtype), dtype))
    assert out.shape == shape and out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float64), _rows(root, shape, "float64"))
    _same_everywhere(comm, out)


@mpi
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (4, 3), (2, 0)])
def test_allgather_inside_jit(comm, mj, dtype: str, shape: tuple[int, ...]) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    out = jax.jit(mj.allgather)(_put(_rows(rank, shape, dtype), dtype))
    expected = np.concatenate([_rows(r, shape, "float64") for r in range(size)])
    assert out.shape == expected.shape and out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float64), expected)
    _same_everywhere(comm, out)


@mpi
def test_one_program_with_every_collective_and_outside_jit(comm, mj) -> None:
    """allreduce, broadcast and allgather in one program, independent of each other (only the token orders
    them); the same calls outside jit give the same arrays."""
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _put(_rows(rank, (6,), "float64"), "float64")

    def f(v):
        return mj.allgather(v[:2]), mj.allreduce(v, "sum"), mj.broadcast(v, 0), mj.allgather(v)

    lowered = jax.jit(f).lower(x).as_text()
    assert [lowered.count(f"custom_call @mpigpu_{c}") for c in ("allreduce", "broadcast", "allgather")] == [1, 1, 2]
    inside, outside = jax.jit(f)(x), f(x)
    everyone = [_rows(r, (6,), "float64") for r in range(size)]
    expected = [np.concatenate([e[:2] for e in everyone]), sum(everyone), everyone[0], np.concatenate(everyone)]
    for got, again, want in zip(inside, outside, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(again), want)


@mpi
def test_grad_is_the_sum_of_the_cotangents(comm, mj) -> None:
    """The loss is the sum of the ranks' losses L_s = sum(c_s * y_s): broadcast's gradient reaches root's x
    only (sum_s c_s); allgather's is each rank's own rows of sum_s c_s."""
    rank, size = comm.Get_rank(), comm.Get_size()
    root = size - 1
    c = [np.arange(8, dtype=np.float64) % 3 + s for s in range(size)]
    w = _put(np.ones(4), "float64")
    g_b = jax.jit(jax.grad(lambda v: jnp.sum(jnp.asarray(c[rank][:4]) * mj.broadcast(v, root))))(w)
    total = sum(c)
    np.testing.assert_array_equal(np.asarray(g_b), total[:4] if rank == root else np.zeros(4))
    gathered_c = [np.arange(4 * size, dtype=np.float64) % 5 + s for s in range(size)]
    g_a = jax.jit(jax.grad(lambda v: jnp.sum(jnp.asarray(gathered_c[rank]) * mj.allgather(v))))(w)
    np.testing.assert_array_equal(np.asarray(g_a), sum(gathered_c)[rank * 4 : (rank + 1) * 4])


@mpi
def test_vmap(comm, mj) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    xb = np.stack([_rows(rank, (3, 2), "float64") + 100 * b for b in range(4)])  # batch of 4 on axis 0
    gathered = jax.jit(jax.vmap(mj.allgather))(_put(xb, "float64"))
    for b in range(4):
        np.testing.assert_array_equal(
            np.asarray(gathered[b]), np.concatenate([_rows(r, (3, 2), "float64") + 100 * b for r in range(size)])
        )
    sent = jax.jit(jax.vmap(lambda v: mj.broadcast(v, 0), in_axes=1, out_axes=1))(_put(xb, "float64"))
    np.testing.assert_array_equal(np.asarray(sent), np.stack([_rows(0, (3, 2), "float64") + 100 * b for b in range(4)]))


@pytest.mark.mpi(min_size=2)
def test_root_mismatch_raises_on_every_rank_while_compiling(comm, mj) -> None:
    rank = comm.Get_rank()
    x = _put(np.ones(3), "float64")
    with pytest.raises(MismatchError, match="root"):
        jax.jit(lambda v: mj.broadcast(v, 1 if rank == 0 else 0))(x)
    out = jax.jit(lambda v: mj.broadcast(v * rank, 1))(x)  # the next call pairs
    np.testing.assert_array_equal(np.asarray(out), np.ones(3))


@mpi
def test_invalid_arguments_are_refused_on_the_callers_line(comm, mj) -> None:
    x = _put(np.ones(3), "float64")
    with pytest.raises(InvalidArgument, match="root"):
        mj.broadcast(x, comm.Get_size())
    with pytest.raises(InvalidArgument, match="first dimension"):
        jax.jit(mj.allgather)(_put(np.float64(1.0), "float64"))
    with pytest.raises(InvalidArgument, match="backend"):
        mj.allgather(x, backend=3)
