"""torch.distributed over mpigpu: the process-group backend "mpigpu", and torch's rendezvous from MPI.

    import mpigpu.torch                       # registers the backend; starts no MPI
    dist.init_process_group("mpigpu")         # under mpiexec -n N: rank, size and store from MPI

Importing this package registers the backend "mpigpu" for CPU and CUDA tensors
(``dist.Backend.register_backend``) and lets torch's default ``env://`` rendezvous fall back on MPI
when RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT is not set (``_rendezvous``), so the plain call
above works for any backend ("gloo", "nccl", "cpu:gloo,cuda:mpigpu"). ``init_process_group`` below
does the same without touching the environment's rules. Each collective is one call of mpigpu's
road (``_group``); docs/torch-distributed.md says what maps to what."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mpigpu.core.errors import MissingDependency
from mpigpu.torch._group import ProcessGroupMpigpu, create
from mpigpu.torch._rendezvous import install, mpi_rendezvous

__all__ = ["BACKEND", "ProcessGroupMpigpu", "init_process_group", "mpi_rendezvous"]

BACKEND = "mpigpu"


def init_process_group(backend: str = BACKEND, *, timeout: timedelta | None = None, **kwargs: Any) -> None:
    """``dist.init_process_group(backend, ...)`` with rank, world size and store from MPI (collective
    over MPI's world). ``backend``: "mpigpu", "gloo", "nccl" or a device split such as
    "cpu:gloo,cuda:mpigpu". ``timeout``: the store's and the group's; for "mpigpu" a call that outlasts
    it ends the job with the stall report (MPIGPU_TIMEOUT where not given). Other keywords (``device_id``,
    ``pg_options``) go to torch; ``store``/``init_method`` are refused (the rendezvous is MPI's)."""
    if "store" in kwargs or "init_method" in kwargs:
        raise ValueError("mpigpu.torch.init_process_group makes the store from MPI: use dist.init_process_group")
    store, rank, size = mpi_rendezvous(dist.default_pg_timeout if timeout is None else timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **kwargs)


def _register() -> None:
    if not dist.is_available():
        raise MissingDependency("this torch has no torch.distributed: install a torch built with it")
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
    install()


_register()
