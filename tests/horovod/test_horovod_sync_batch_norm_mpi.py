"""hvd.SyncBatchNorm on CPU tensors, at any number of ranks: against torch's BatchNorm over every rank's
batch stacked (float64, tight tolerances) in every option and layout, ranks with batches of different
sizes (an empty one too), the half types, a process set; every rank raises when one rank's input is
bad or the whole batch has one value per channel, and a rank whose input needs no gradient still takes
part in backward. tests/gpu/test_horovod_gpu.py runs the same comparison on CUDA tensors, where
torch's own kernels do the arithmetic."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

from sync_batch_norm_check import SIZES, compare  # noqa: E402

import mpigpu.horovod.torch as hvd  # noqa: E402

pytestmark = pytest.mark.mpi

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(scope="module", autouse=True)
def _hvd():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize(("tail", "channels_last"), [((), False), ((3,), False), ((2, 3), False), ((2, 3), True),
                                                     ((2, 1, 2), True)])  # fmt: skip
@pytest.mark.parametrize("loss", ["weighted", "sum"])
def test_matches_batch_norm_on_the_whole_batch(sizes, tail, channels_last, loss) -> None:
    compare(hvd, SIZES[sizes](hvd.size()), 3, tail, channels_last=channels_last, loss=loss, **TIGHT)


@pytest.mark.parametrize(
    "options",
    [{"momentum": None}, {"affine": False}, {"track_running_stats": False}, {"eps": 0.5, "momentum": 0.5}],
    ids=["cumulative", "no affine", "no running stats", "eps momentum"],
)
def test_options(options) -> None:
    compare(hvd, SIZES["uneven"](hvd.size()), 2, (3,), steps=3, **options, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_and_single_precision_inputs(dtype) -> None:
    """Statistics in float32 as torch's; the output rounds to the input's type."""
    tolerance = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5}[dtype]
    compare(hvd, SIZES["uneven"](hvd.size()), 3, (4,), dtype=dtype, rtol=tolerance, atol=tolerance)


@pytest.mark.mpi(min_size=2)
def test_a_process_set() -> None:
    """The set of ranks 1 .. size-1 normalises over its own batches; rank 0 outside raises alone."""
    process_set = hvd.add_process_set(list(range(1, hvd.size())))
    try:
        if hvd.rank() == 0:
            with pytest.raises(ValueError):
                hvd.SyncBatchNorm(2, process_set=process_set)(torch.ones(4, 2))
        elif process_set.size() > 1:
            compare(hvd, SIZES["uneven"](process_set.size()), 2, (3,), process_set=process_set, **TIGHT)
        else:  # a set of one rank: its own batch
            compare(hvd, [5], 2, (3,), process_set=process_set, **TIGHT)
    finally:
        hvd.remove_process_set(process_set)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", [torch.ones(4), torch.ones(4, 3, 2)], ids=["1-D", "3 channels"])
def test_a_bad_input_on_one_rank_raises_on_every_rank(bad) -> None:
    sync = hvd.SyncBatchNorm(2)
    kind = ValueError if hvd.rank() == 0 else hvd.HorovodInternalError
    with pytest.raises(kind):
        sync(bad if hvd.rank() == 0 else torch.ones(4, 2, 2))
    n = hvd.size()
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)))  # still paired


def test_one_value_per_channel_in_the_whole_batch_raises_on_every_rank() -> None:
    """As torch's BatchNorm in training; only rank 0 has a row, so the others' batches are empty."""
    sync = hvd.SyncBatchNorm(2)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(torch.ones(1 if hvd.rank() == 0 else 0, 2, 1))
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(hvd.size())))


@pytest.mark.mpi(min_size=2)
def test_a_rank_whose_input_needs_no_gradient_takes_part_in_backward() -> None:
    """Rank 0's input needs no gradient (its weight's does): its backward still adds its sums for the
    other ranks' input gradients, which match torch's."""
    r, n = hvd.rank(), hvd.size()
    whole = torch.arange(n * 3 * 2 * 2, dtype=torch.float64).reshape(n * 3, 2, 2) % 7
    mine = whole[3 * r : 3 * r + 3].clone().requires_grad_(r > 0)
    (hvd.SyncBatchNorm(2).double()(mine) * (r + 1)).sum().backward()
    whole.requires_grad_()
    weights = torch.arange(n, dtype=torch.float64).repeat_interleave(3).view(-1, 1, 1) + 1
    (torch.nn.BatchNorm1d(2).double()(whole) * weights).sum().backward()
    if r > 0:
        assert torch.allclose(mine.grad, whole.grad[3 * r : 3 * r + 3], **TIGHT)
