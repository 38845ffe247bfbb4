"""DDP on CPU over the "mpigpu" backend, beside the same run over gloo in the same processes.

An MLP trains a few SGD steps on data that differs per rank, once with DDP over the default group
(mpigpu) and once over a gloo group of the same ranks, from the same initial parameters; the final
parameters are compared. At 1 and 2 ranks they must be the same bits: DDP divides each gradient by
the world size before the sum, and a sum of two numbers is one rounding in any order (float16: the
hook's sums of two halves, exact in mpigpu's float32 accumulator, rounded once as gloo rounds them).
At 3 and more ranks gloo's ring adds in an order of its own and mpigpu reduces in one fixed order, so
the parameters agree to float32 rounding (rtol 1e-5), or with the fp16 hook to float16 rounding of
the gradients (atol 1e-4 after the steps), not bitwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import mpigpu.torch  # noqa: E402, F401  (registers the backend)

pytestmark = pytest.mark.mpi

STEPS = 4


@pytest.fixture(scope="module")
def gloo() -> Any:
    dist.init_process_group("mpigpu")
    group = dist.new_group(backend="gloo")
    yield group
    dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(1234 + dist.get_rank())  # different per rank: DDP's broadcast from rank 0 must make them one
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + micro)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train(group: Any, *, hook: Callable[..., Any] | None = None, static: bool = False, accumulate: int = 1) -> list:
    model = DDP(_model(), process_group=group, static_graph=static, bucket_cap_mb=0.001)  # several buckets
    if hook is not None:
        model.register_comm_hook(group, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulate - 1):
            with model.no_sync():
                x, y = _batch(step, micro)
                torch.nn.functional.mse_loss(model(x), y).backward()
        x, y = _batch(step, accumulate)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _same(ours: list, theirs: list, half: bool) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        if dist.get_world_size() <= 2:
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            torch.testing.assert_close(a, b, rtol=1e-3 if half else 1e-5, atol=1e-4 if half else 1e-6)
    everyone = [torch.empty_like(torch.cat([p.reshape(-1) for p in ours])) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.cat([p.reshape(-1) for p in ours]))
    assert all(torch.equal(e, everyone[0]) for e in everyone)  # one model on every rank
    assert not torch.equal(ours[0], _model()[0].weight.detach())  # it trained


@pytest.mark.parametrize("kind", ["plain", "static_graph", "no_sync", "fp16_compress_hook"], ids=lambda k: k)
def test_ddp_over_mpigpu_ends_where_ddp_over_gloo_ends(gloo: Any, kind: str) -> None:
    options: dict[str, Any] = {
        "plain": {},
        "static_graph": {"static": True},
        "no_sync": {"accumulate": 3},
        "fp16_compress_hook": {"hook": default_hooks.fp16_compress_hook},
    }[kind]
    ours = _train(dist.group.WORLD, **options)
    theirs = _train(gloo, **options)
    _same(ours, theirs, half="hook" in options)
