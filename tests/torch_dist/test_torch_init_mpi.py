"""Making and destroying groups over MPI's rendezvous: the helper for every backend, device splits,
and what ``destroy_process_group`` frees."""

from __future__ import annotations

from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

import torch.distributed as dist  # noqa: E402

import mpigpu.torch  # noqa: E402
from mpigpu.core._mpi import world  # noqa: E402
from mpigpu.runtime.context import Context  # noqa: E402

pytestmark = pytest.mark.mpi


def _rank_sum(count: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    r, n = dist.get_rank(), dist.get_world_size()
    return torch.arange(count, dtype=torch.float64) + r, torch.arange(count, dtype=torch.float64) * n + n * (n - 1) / 2


@pytest.mark.parametrize("backend", ["gloo", "mpigpu"])
def test_the_helper_gives_any_backend_mpis_rank_size_and_store(backend: str) -> None:
    mpigpu.torch.init_process_group(backend, timeout=timedelta(seconds=60))
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (world().Get_rank(), world().Get_size())
        assert dist.get_backend() == backend
        t, expected = _rank_sum()
        dist.all_reduce(t)
        assert torch.equal(t, expected)
    finally:
        dist.destroy_process_group()


def test_cpu_gloo_cuda_mpigpu_hands_cpu_tensors_to_gloo() -> None:
    """gloo's own refusal (ReduceOp.BAND of floats, a RuntimeError; mpigpu's is an InvalidArgument
    naming mpigpu) proves which backend the CPU call met."""
    dist.init_process_group("cpu:gloo,cuda:mpigpu")
    try:
        t, expected = _rank_sum()
        dist.all_reduce(t)
        assert torch.equal(t, expected)
        with pytest.raises(RuntimeError) as raised:
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
        assert "mpigpu" not in str(raised.value)
    finally:
        dist.destroy_process_group()


def test_cpu_mpigpu_cuda_gloo_keeps_cpu_tensors_on_mpigpu() -> None:
    dist.init_process_group("cpu:mpigpu,cuda:gloo")
    try:
        t, expected = _rank_sum()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert torch.equal(t, expected / dist.get_world_size())
    finally:
        dist.destroy_process_group()


def test_destroy_frees_the_groups_communicators_and_contexts() -> None:
    live = len(Context._live)
    dist.init_process_group("mpigpu")
    world_group = dist.group.WORLD
    sub = dist.new_group(list(range(dist.get_world_size())))
    for group in (world_group, sub):
        t, expected = _rank_sum()
        dist.all_reduce(t, group=group)
        assert torch.equal(t, expected)
    made = [world_group._comm, sub._comm]
    assert len(Context._live) == live + 2
    dist.destroy_process_group()
    assert len(Context._live) == live
    assert world_group._comm is None and sub._comm is None
    for comm in made:
        assert comm == type(comm)()  # freed: MPI_COMM_NULL


def test_a_timeout_given_is_the_groups_watchdog_timeout() -> None:
    dist.init_process_group("mpigpu", timeout=timedelta(seconds=42))
    try:
        watchdog = Context.get(dist.group.WORLD._comm).watchdog
        assert watchdog.timeout == 42.0 and watchdog.on
    finally:
        dist.destroy_process_group()
