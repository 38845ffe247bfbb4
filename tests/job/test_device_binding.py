"""The GPU is the process's: a communicator smaller than the world takes the node-local rank from the
launcher, not from its own ranks (rank 1 of 2, alone in a Horovod process set, was mapped to GPU 0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpigpu.core import _mpi
from mpigpu.job import device

LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                   "PALS_LOCAL_RANKID", "SLURM_LOCALID")  # fmt: skip


class _World:
    def Get_size(self) -> int:
        return 4


@pytest.fixture
def launcher(monkeypatch):
    for var in LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(device, "world", _World)
    return monkeypatch


def test_the_world_sized_communicator_uses_its_node_rank(launcher) -> None:
    launcher.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    assert device._node_local_rank(SimpleNamespace(size=4, phys_rank=1)) == 1


@pytest.mark.parametrize("var", LOCAL_RANK_VARS)
def test_a_smaller_communicator_uses_the_launchers_local_rank(launcher, var: str) -> None:
    launcher.setenv(var, "1")
    assert device._node_local_rank(SimpleNamespace(size=1, phys_rank=0)) == 1
    assert _mpi.launcher_local_rank() == 1


def test_without_a_launcher_a_smaller_communicator_falls_back_to_its_node_rank(launcher) -> None:
    launcher.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "not a number")
    assert device._node_local_rank(SimpleNamespace(size=2, phys_rank=1)) == 1
