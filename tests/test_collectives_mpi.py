"""broadcast, allgather, broadcast_object, allgather_object, broadcast_parameters and
broadcast_optimizer_state on the host (NumPy, torch CPU) under mpiexec (-n 1 to 4).

Data: every element a value that depends on its rank and index (exact in every dtype), receivers
poisoned beforehand, results compared byte for byte with a reference built from the pattern.
Errors: a mismatch (dtype, trailing dimensions, root, placement, backend) or a rank rejecting its
own arguments raises on every rank, and no array changes."""

from __future__ import annotations

import numpy as np
import pytest

import mpigpu
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import InvalidArgument, MismatchError

pytestmark = pytest.mark.mpi(min_size=1)

HOST_BACKENDS = ["auto", "cpu", "host"]
POISON = 0xA5


def _pattern(rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Rank ``rank``'s values: (7r + i) mod 100 plus 1, exact in every dtype, never the poison."""
    count = int(np.prod(shape))
    values = (7 * rank + np.arange(count)) % 100 + 1
    return values.astype(np.float64).astype(DTYPES[dtype].np).reshape(shape)


def _poisoned(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    arr = np.empty(shape, DTYPES[dtype].np)
    arr.reshape(-1).view(np.uint8)[...] = POISON
    return arr


def _rows(rank: int) -> int:
    return (rank * 3 + 2) % 5  # 2, 0, 3, 1 on ranks 0..3: zero rows on rank 1


# -- broadcast ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_broadcast_every_root_every_dtype(comm, dtype: str, backend: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    shape = (3, 5)
    for root in range(size):
        x = _pattern(root, shape, dtype) if rank == root else _poisoned(shape, dtype)
        returned = mpigpu.broadcast(x, root, comm=comm, backend=backend)
        assert returned is x
        assert x.tobytes() == _pattern(root, shape, dtype).tobytes()


@pytest.mark.parametrize("count", [0, 1, 1000003])
def test_broadcast_sizes(comm, count: int) -> None:
    rank = comm.Get_rank()
    x = _pattern(0, (count,), "float32") if rank == 0 else _poisoned((count,), "float32")
    mpigpu.broadcast(x, comm=comm)
    assert x.tobytes() == _pattern(0, (count,), "float32").tobytes()


def test_broadcast_torch_cpu(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    root = size - 1
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = torch.arange(12, dtype=dtype).reshape(3, 4) * (rank + 1)
        assert mpigpu.broadcast(x, root, comm=comm) is x
        assert torch.equal(x, torch.arange(12, dtype=dtype).reshape(3, 4) * (root + 1))


def test_broadcast_jax_returns_a_new_array(comm) -> None:
    jnp = pytest.importorskip("jax.numpy")
    pytest.importorskip("mpigpu.jax").init()  # JAX's default device: the rank's (under Open MPI: GPU 0 on all)
    rank = comm.Get_rank()
    x = jnp.full((4,), float(rank + 1), jnp.float32)
    y = mpigpu.broadcast(x, comm=comm)
    assert np.array_equal(np.asarray(y), np.full(4, 1.0, np.float32))
    assert np.array_equal(np.asarray(x), np.full(4, float(rank + 1), np.float32))  # x untouched


# -- allgather ------------------------------------------------------------------------------------
def _gathered(size: int, trailing: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.concatenate([_pattern(r, (_rows(r), *trailing), dtype) for r in range(size)])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_allgather_unequal_rows_every_dtype(comm, dtype: str, backend: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    trailing = (2, 3)
    x = _pattern(rank, (_rows(rank), *trailing), dtype)
    before = x.copy()
    out = mpigpu.allgather(x, comm=comm, backend=backend)
    expected = _gathered(size, trailing, dtype)
    assert type(out) is np.ndarray and out.dtype == x.dtype and out.shape == expected.shape
    assert out.tobytes() == expected.tobytes()
    assert x.tobytes() == before.tobytes()


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_allgather_equal_rows_and_1d(comm, backend: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _pattern(rank, (4,), "int32")
    out = mpigpu.allgather(x, comm=comm, backend=backend)
    assert out.tobytes() == np.concatenate([_pattern(r, (4,), "int32") for r in range(size)]).tobytes()


def test_allgather_all_empty(comm) -> None:
    out = mpigpu.allgather(np.empty((0, 3), np.float32), comm=comm)
    assert out.shape == (0, 3) and out.dtype == np.float32


def test_allgather_torch_cpu(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        x = torch.full((_rows(rank), 2), rank + 1, dtype=dtype)
        out = mpigpu.allgather(x, comm=comm)
        expected = torch.cat([torch.full((_rows(r), 2), r + 1, dtype=dtype) for r in range(size)])
        assert isinstance(out, torch.Tensor) and out.dtype == dtype
        assert torch.equal(out, expected)


def test_allgather_refuses_a_0d_array_on_every_rank(comm) -> None:
    rank = comm.Get_rank()
    x = np.float32(3.0) if rank == 0 else np.ones(1, np.float32)
    expected = InvalidArgument if rank == 0 else MismatchError
    if comm.Get_size() == 1:
        expected = InvalidArgument
    with pytest.raises(expected, match=r"first dimension|rank 0"):
        mpigpu.allgather(x, comm=comm)


# -- mismatches: every rank raises, no array changes ------------------------------------------------
def _mismatch(comm, call, receivers: list[np.ndarray]) -> None:
    before = [r.tobytes() for r in receivers]
    if comm.Get_size() == 1:
        return
    with pytest.raises(MismatchError):
        call()
    assert [r.tobytes() for r in receivers] == before
    # the communicator still works afterwards
    y = np.full(3, comm.Get_rank(), np.float32) if comm.Get_rank() == 0 else _poisoned((3,), "float32")
    mpigpu.broadcast(y, comm=comm)
    assert (y == 0).all()


def test_broadcast_dtype_mismatch(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (4,), "float32" if rank == 0 else "float64")
    _mismatch(comm, lambda: mpigpu.broadcast(x, comm=comm), [x])


def test_broadcast_shape_mismatch(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (4, 2) if rank == 0 else (2, 4), "int16")
    _mismatch(comm, lambda: mpigpu.broadcast(x, comm=comm), [x])


def test_broadcast_root_mismatch(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (5,), "float32")
    _mismatch(comm, lambda: mpigpu.broadcast(x, rank, comm=comm), [x])


def test_broadcast_backend_mismatch(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (5,), "float32")
    _mismatch(comm, lambda: mpigpu.broadcast(x, comm=comm, backend="cpu" if rank == 0 else "host"), [x])


def test_a_rank_rejecting_its_argument_reaches_every_rank(comm) -> None:
    """A rank passing something that is not an array rejects it locally; the other ranks raise
    MismatchError naming it. (Host/GPU placement mismatches: tests/gpu/test_collectives_gpu.py.)"""
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _pattern(rank, (5,), "float32")
    before = x.tobytes()
    bad = rank == size - 1
    with pytest.raises(InvalidArgument if bad else MismatchError):
        mpigpu.broadcast("not an array" if bad else x, comm=comm)
    assert x.tobytes() == before


def test_broadcast_bad_root_on_every_rank(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (5,), "float32")
    before = x.tobytes()
    with pytest.raises(InvalidArgument, match="root"):
        mpigpu.broadcast(x, comm.Get_size(), comm=comm)
    assert x.tobytes() == before


def test_broadcast_read_only(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _pattern(rank, (5,), "float32")
    if rank == size - 1:
        x.flags.writeable = False
    with pytest.raises(InvalidArgument if rank == size - 1 else MismatchError):
        mpigpu.broadcast(x, comm=comm)
    assert x.tobytes() == _pattern(rank, (5,), "float32").tobytes()


def test_allgather_trailing_dims_mismatch(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (2, 3) if rank == 0 else (2, 4), "float32")
    _mismatch(comm, lambda: mpigpu.allgather(x, comm=comm), [x])


def test_allgather_dtype_mismatch(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (2, 3), "int32" if rank == 0 else "uint32")
    _mismatch(comm, lambda: mpigpu.allgather(x, comm=comm), [x])


def test_allgather_backend_mismatch(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (2,), "float32")
    _mismatch(comm, lambda: mpigpu.allgather(x, comm=comm, backend="cpu" if rank == 0 else "host"), [x])


def test_different_collectives_mismatch(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (4,), "float32")
    call = (lambda: mpigpu.broadcast(x, comm=comm)) if rank == 0 else (lambda: mpigpu.allgather(x, comm=comm))
    _mismatch(comm, call, [x])


def test_ipc_does_not_broadcast(comm) -> None:
    x = np.zeros(3, np.float32)
    with pytest.raises((InvalidArgument, mpigpu.BackendUnavailable)):
        mpigpu.broadcast(x, comm=comm, backend="ipc")


# -- objects ----------------------------------------------------------------------------------------
def test_broadcast_object_every_root(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    for root in range(size):
        obj = {"rank": rank, "data": list(range(rank * 100)), "rng": np.random.default_rng(rank).bit_generator.state}
        got = mpigpu.broadcast_object(obj, root, comm=comm)
        assert got["rank"] == root and got["data"] == list(range(root * 100))
        assert got["rng"] == np.random.default_rng(root).bit_generator.state


def test_allgather_object(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    got = mpigpu.allgather_object(("rank", rank, "x" * rank), comm=comm)
    assert got == [("rank", r, "x" * r) for r in range(size)]


def test_broadcast_object_root_mismatch_and_unpicklable(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    if size > 1:
        with pytest.raises(MismatchError, match="root"):
            mpigpu.broadcast_object(rank, rank, comm=comm)
    unpicklable = (lambda: None) if rank == 0 else None
    with pytest.raises(Exception) as info:
        mpigpu.broadcast_object(unpicklable, 0, comm=comm)
    assert rank == 0 or isinstance(info.value, MismatchError)
    assert mpigpu.broadcast_object(rank, comm=comm) == 0  # still in step


# -- training helpers ---------------------------------------------------------------------------------
def _model(seed: int):
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        model[1].running_mean.fill_(float(seed))
    return model


def _flat(model) -> list[bytes]:
    return [t.detach().numpy().tobytes() for _, t in sorted(model.state_dict().items())]


@pytest.mark.parametrize("form", ["state_dict", "named_parameters", "module", "parameters"])
def test_broadcast_parameters_different_seeds_end_equal(comm, form: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    root = size - 1
    model, reference = _model(100 + rank), _model(100 + root)
    params = {
        "state_dict": model.state_dict(),
        "named_parameters": model.named_parameters(),
        "module": model,
        "parameters": model.parameters(),
    }[form]
    mpigpu.broadcast_parameters(params, root, comm=comm)
    if form in ("state_dict", "module"):  # buffers too
        assert _flat(model) == _flat(reference)
    else:
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert mine.detach().numpy().tobytes() == theirs.detach().numpy().tobytes()


def test_broadcast_parameters_bool_complex_and_non_contiguous(comm) -> None:
    """dtypes mpigpu does not reduce still move (as their bits); a transposed tensor through a copy."""
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    root = size - 1

    def make(r: int) -> dict:
        gen = torch.Generator().manual_seed(r)
        return {
            "mask": torch.rand(4, 4, generator=gen) > 0.5,
            "phase": torch.randn(3, dtype=torch.complex64, generator=gen),
            "t": torch.randn(3, 5, generator=gen).t(),
            "np": (torch.rand(6, generator=gen) > 0.5).numpy(),
        }

    mine, want = make(rank), make(root)
    assert not mine["t"].is_contiguous()
    mpigpu.broadcast_parameters(mine, root, comm=comm)
    for name in ("mask", "phase", "t"):
        assert torch.equal(mine[name], want[name]), name
    assert (mine["np"] == want["np"]).all()


def test_broadcast_parameters_name_mismatch(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    params = {"a" if rank == 0 else "b": torch.full((3,), float(rank))}
    if size == 1:
        return
    with pytest.raises(MismatchError, match="differ"):
        mpigpu.broadcast_parameters(params, comm=comm)
    assert next(iter(params.values())).tolist() == [float(rank)] * 3


def test_broadcast_parameters_shape_mismatch(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    params = {"w": torch.full((3,) if rank == 0 else (4,), float(rank))}
    if size == 1:
        return
    with pytest.raises(MismatchError):
        mpigpu.broadcast_parameters(params, comm=comm)
    assert params["w"].tolist() == [float(rank)] * (3 if rank == 0 else 4)


def test_broadcast_optimizer_state_created_on_root_only(comm) -> None:
    torch = pytest.importorskip("torch")
    rank = comm.Get_rank()
    model = _model(7)  # the same parameters everywhere: only the optimizer differs
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), betas=(0.8, 0.9 - 0.01 * rank))
    if rank == 0:
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
    mpigpu.broadcast_optimizer_state(optimizer, 0, comm=comm)
    state = optimizer.state_dict()
    assert optimizer.param_groups[0]["lr"] == 0.01 and optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert len(state["state"]) == len(list(model.parameters()))
    mine = [(k, kk, v.numpy().tobytes()) for k, e in sorted(state["state"].items()) for kk, v in sorted(e.items())]
    everyone = mpigpu.allgather_object(mine, comm=comm)
    expected = everyone[0]
    assert all(other == expected for other in everyone)
    assert float(state["state"][0]["step"]) == 1.0
    # the state works: with rank 0's parameters everywhere, one more step (same gradients) gives the same
    # parameters on every rank; a rank without rank 0's moments and step count would differ
    mpigpu.broadcast_parameters(model.state_dict(), comm=comm)
    model.zero_grad()
    model(torch.ones(5, 3)).sum().backward()
    optimizer.step()
    flats = mpigpu.allgather_object(_flat(model), comm=comm)
    assert all(f == flats[0] for f in flats)


def test_broadcast_optimizer_state_group_mismatch(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    model = _model(1)
    params = list(model.parameters())
    groups = [{"params": params}] if rank == 0 else [{"params": params[:2]}, {"params": params[2:]}]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    if size == 1:
        return
    with pytest.raises(MismatchError if rank == 0 else InvalidArgument):
        mpigpu.broadcast_optimizer_state(optimizer, comm=comm)


# -- Averager and BackwardAverager broadcast at construction ------------------------------------------------
def test_averager_broadcasts_rank0_parameters_by_default(comm) -> None:
    rank = comm.Get_rank()
    model, reference = _model(50 + rank), _model(50)
    mpigpu.Averager(model, comm=comm)
    assert _flat(model) == _flat(reference)  # buffers too (a Module)


def test_averager_broadcast_false_keeps_parameters(comm) -> None:
    rank = comm.Get_rank()
    model, reference = _model(50 + rank), _model(50 + rank)
    mpigpu.Averager(model, comm=comm, broadcast=False)
    assert _flat(model) == _flat(reference)


def test_backward_averager_broadcasts_rank0_parameters_by_default(comm) -> None:
    rank = comm.Get_rank()
    model, reference = _model(60 + rank), _model(60)
    mpigpu.BackwardAverager(model, comm=comm).close()
    assert _flat(model) == _flat(reference)
    other = _model(70 + rank)
    before = _flat(other)
    mpigpu.BackwardAverager(other, comm=comm, broadcast=False).close()
    assert _flat(other) == before


# -- the per-call cost: one exchange per allgather, the last call's validation remembered ---------------
def test_allgather_rows_travel_in_the_check(comm, monkeypatch) -> None:
    """The first dimensions ride in the cross-rank check: equal ones (through MPI or the check board)
    and unequal ones on one node (read from the board) need no MPI_Allgather of their own."""
    import mpigpu.calls.move as collectives
    from mpigpu.runtime.context import Context

    def no_gather(ctx, mine):
        raise AssertionError("an extra MPI_Allgather of the first dimensions")

    monkeypatch.setattr(collectives, "_gather_rows", no_gather)
    rank, n = comm.Get_rank(), comm.Get_size()
    assert Context.get(comm).check_board is not None  # one node: the board carries the rows
    for rows_of in (lambda r: 3, _rows):  # equal first dimensions, then unequal ones
        x = _pattern(rank, (rows_of(rank), 2), "int32")
        y = mpigpu.allgather(x, comm=comm)
        expected = np.concatenate([_pattern(r, (rows_of(r), 2), "int32") for r in range(n)])
        assert y.tobytes() == expected.tobytes()


@pytest.mark.parametrize("board", [True, False])
def test_check_rows_returns_every_ranks_rows_or_raises_on_every_rank(comm, board: bool) -> None:
    from mpigpu.job.check import Signature, check_rows
    from mpigpu.job.check_board import board_for
    from mpigpu.runtime.context import Context

    rank, n = comm.Get_rank(), comm.Get_size()
    ctx = Context.get(comm)
    checked = ctx.comm if board else comm.Dup()
    try:
        assert (board_for(checked) is not None) is board

        def sig(rows: int, **changes) -> Signature:
            return Signature(
                count=2, dtype=3, op=0, backend=1, placement=0, shape=(2,), collective=2, root=rows
            )._replace(**changes)

        assert check_rows(checked, sig(4)) == [4] * n
        unequal = check_rows(checked, sig(_rows(rank)))
        assert unequal == ([_rows(r) for r in range(n)] if board or n == 1 else None)
        if n > 1:  # another field differs as well: the message names it, never the first dimension
            with pytest.raises(MismatchError, match="dtype") as info:
                check_rows(checked, sig(_rows(rank), dtype=3 + (rank == n - 1)))
            assert "root:" not in str(info.value)
            with pytest.raises(MismatchError, match="rank 0"):  # a rank that failed
                check_rows(checked, sig(4, error="InvalidArgument: bad" if rank == 0 else None))
        assert check_rows(checked, sig(5)) == [5] * n  # still paired after the errors
    finally:
        if not board:
            checked.Free()


def test_a_remembered_broadcast_is_validated_again_when_its_array_changes(comm) -> None:
    rank = comm.Get_rank()
    x = _pattern(rank, (4,), "float32")
    mpigpu.broadcast(x, comm=comm)  # remembered: the same values skip validation
    mpigpu.broadcast(x, comm=comm)
    x.flags.writeable = False  # the same array, now read-only: validated again, refused on every rank
    expected = InvalidArgument if rank == 0 or comm.Get_size() == 1 else (InvalidArgument, MismatchError)
    with pytest.raises(expected, match="read-only"):
        mpigpu.broadcast(x, comm=comm)
    y = _pattern(rank, (2, 2), "float32") if rank == 0 else _poisoned((2, 2), "float32")
    mpigpu.broadcast(y, comm=comm)  # another shape after the memo: right bytes
    assert y.tobytes() == _pattern(0, (2, 2), "float32").tobytes()
