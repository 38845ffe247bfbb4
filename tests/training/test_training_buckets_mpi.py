"""BackwardAverager rebuilds its buckets once, after the first averaged step, in the order the
gradients arrived (as DDP does), under mpiexec (-n 1 to 4), torch on the host: a model whose
forward uses its layers in another order than it registered them gets its buckets in backward order;
ranks whose orders differ all take rank 0's; and the gradients before, at and after the rebuild are
bitwise the exact average, equal to torch.distributed's all_reduce (gloo SUM / n: gloo has no AVG,
and n is a power of two) of a twin model's gradients. Integer weights, inputs and loss weights make
every gradient an integer below 2**24, so every sum is exact in any order."""

from __future__ import annotations

import copy

import numpy as np
import pytest

WIDTH = 4  # Linear(4, 4): 64 + 16 bytes, so an 80-byte cap gives each layer its own bucket


def _model(torch, path: list[int]):
    """Four Linear layers, registered 0..3, applied in the order ``path``; integer weights."""

    class Shuffled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
            self.path = path
            gen = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randint(-1, 2, p.shape, generator=gen).float())

        def forward(self, x):
            for i in self.path:
                x = self.layers[i](x)
            return x

    return Shuffled()


def _backward(torch, model, rank: int, step: int) -> None:
    """A rank- and step-dependent integer loss: sum(out * c), c in -2..2, x in -1..1."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(-1, 2, (2, WIDTH), generator=gen).float()
    c = torch.randint(-2, 3, (2, WIDTH), generator=gen).float()
    (model(x) * c).sum().backward()


def _layers(bucket_parameters: list[list[int]]) -> list[set[int]]:
    """Buckets as sets of layer numbers (parameter positions: layer k's weight 2k, bias 2k + 1)."""
    return [{i // 2 for i in bucket} for bucket in bucket_parameters]


def _backward_order(path: list[int]) -> list[set[int]]:
    return [{layer} for layer in path[::-1]]


@pytest.fixture(scope="module")
def torch_group(comm):
    """torch.distributed (gloo) on the test's own communicator, for the reference all_reduce."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import torch.distributed as dist

    from mpigpu.bench.models import init_torch_distributed

    own = comm.Dup()
    init_torch_distributed(own, "gloo")
    yield torch, own
    dist.destroy_process_group()
    own.Free()


def _reference(torch, twin, own, step: int) -> list[np.ndarray]:
    """The twin's gradients averaged by torch.distributed (SUM, then / n): the sum checked against the
    float64 sum (exact), the mean against that sum divided once in float32 (exact at 1, 2 and 4 ranks,
    one rounding at 3)."""
    import torch.distributed as dist

    twin.zero_grad(set_to_none=True)
    _backward(torch, twin, own.Get_rank(), step)
    grads = [p.grad.detach().clone() for p in twin.parameters()]
    everyone = own.allgather([g.numpy() for g in grads])
    averaged = []
    for i, g in enumerate(grads):
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        exact = np.sum([e[i].astype(np.float64) for e in everyone], axis=0)
        assert np.array_equal(g.numpy().astype(np.float64), exact), "the inputs' sums are exact"
        assert np.abs(exact).max() < 2**24 and np.any(exact != 0)
        g /= own.Get_size()
        assert np.array_equal(g.numpy(), exact.astype(np.float32) / np.float32(own.Get_size()))
        averaged.append(g.numpy())
    return averaged


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("paths", ["same", "per_rank"])
def test_buckets_follow_the_observed_gradient_order(comm, torch_group, set_to_none: bool, paths: str) -> None:
    torch, own = torch_group
    from mpigpu.training.torch import BackwardAverager

    rank = comm.Get_rank()
    path = [2, 0, 3, 1] if paths == "same" or rank == 0 else [3, 1, 0, 2]  # rank 0's is used everywhere
    model = _model(torch, path)
    twin = copy.deepcopy(model)  # no hooks: the reference's gradients
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay, the step hook runs
    hooked = BackwardAverager(model, optimizer=optimizer, bucket_bytes=80)
    assert hooked.bucket_parameters == [[7, 6], [5, 4], [3, 2], [1, 0]], "first: registration order, reversed"
    for step in range(4):
        expected = _reference(torch, twin, own, step)
        optimizer.zero_grad(set_to_none=set_to_none)
        _backward(torch, model, rank, step)
        optimizer.step()  # finish(): after the first step also the rebuild
        for p, want in zip(model.parameters(), expected, strict=True):
            assert np.array_equal(p.grad.numpy(), want), f"step {step}"
        assert _layers(hooked.bucket_parameters) == _backward_order([2, 0, 3, 1]), f"after step {step}"
    slots = {s.data_ptr() for b in hooked._averager._buckets for s in b.slots}
    assert {p.grad.data_ptr() for p in model.parameters()} <= slots, "the gradients live in the new buckets"
    hooked.close()


@pytest.mark.mpi(min_size=1)
def test_rebuild_waits_for_an_averaged_step_and_puts_unused_parameters_last(comm) -> None:
    """Backward passes under no_sync() are not observed; parameters that got no gradient in the
    observed step keep their relative order at the end; compressed buckets are rebuilt alike."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from mpigpu.training.torch import BackwardAverager

    rank, n = comm.Get_rank(), comm.Get_size()
    model = _model(torch, [2, 0, 3, 1])
    unused = torch.nn.Linear(WIDTH, WIDTH)  # positions 8 (weight) and 9 (bias)
    params = [*model.parameters(), *unused.parameters()]
    hooked = BackwardAverager(params, bucket_bytes=80, compression="bfloat16")
    assert _layers(hooked.bucket_parameters) == [{4}, {3}, {2}, {1}, {0}]
    model.path = [3, 1, 0, 2]
    with hooked.no_sync():
        _backward(torch, model, rank, 0)  # accumulated locally, not observed (its order would be 2, 0, 1, 3)
    model.path = [2, 0, 3, 1]
    _backward(torch, model, rank, 1)  # the first averaged step (of the sum of both passes): observed
    everyone = comm.allgather([p.grad.clone() for p in model.parameters()])  # sent from the buckets: grads unchanged
    hooked.finish()  # then the rebuild
    assert _layers(hooked.bucket_parameters) == [{1}, {3}, {0}, {2}, {4}], "unused last"
    assert [i for b in hooked.bucket_parameters[-1:] for i in b] == [9, 8], "in their previous order"
    for i, p in enumerate(model.parameters()):
        want = sum(e[i].double() for e in everyone) / n
        assert torch.allclose(p.grad.double(), want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))
    assert torch.all(unused.weight.grad == 0) and torch.all(unused.bias.grad == 0)
    hooked.close()
