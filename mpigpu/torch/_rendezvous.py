"""torch.distributed's rendezvous from MPI: rank, world size and a store, with no MASTER_ADDR/PORT.

``mpi_rendezvous`` is collective over MPI's world. Rank and size are MPI's. The store: on one node a
``FileStore`` in a private directory (made 0700 by rank 0, its path broadcast by MPI, and used by the
other ranks only if it is a directory of this user that no one else can write); across nodes a
``TCPStore`` served by rank 0 on a port the system picks, broadcast by MPI, on rank 0's host name
(``MASTER_ADDR`` where set). Its timeout is the process group's.

``env_or_mpi`` replaces torch's ``env://`` rendezvous handler (the default of ``init_process_group``)
once ``mpigpu.torch`` is imported: with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT all set it is
torch's own; with any missing it is ``mpi_rendezvous``, for every backend."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from mpigpu.core._mpi import MPI

__all__ = ["ENV", "env_or_mpi", "install", "mpi_rendezvous"]

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _private_dir(path: str) -> str:
    """``path`` if it is a directory owned by this user that no one else can write, else ValueError."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"the rendezvous directory {path} is not a private (0700) directory of this user")
    return path


def _file_store(world: Any, timeout: timedelta) -> Any:
    """A FileStore in a fresh private directory of rank 0's (one node)."""
    path = tempfile.mkdtemp(prefix="mpigpu-torch-") if world.Get_rank() == 0 else None
    path = world.bcast(path, root=0)
    if world.Get_rank() == 0:
        atexit.register(shutil.rmtree, path, True)
    try:
        _private_dir(path)
        problem = ""
    except (OSError, ValueError) as exc:
        problem = str(exc)
    problems = [p for p in world.allgather(problem) if p]  # a rank that refuses the directory: every rank raises
    if problems:
        raise ValueError(f"mpigpu.torch's rendezvous did not start: {problems[0]}")
    store = dist.FileStore(os.path.join(path, "store"), world.Get_size())
    store.set_timeout(timeout)
    return store


def _tcp_store(world: Any, timeout: timedelta) -> Any:
    """A TCPStore served by rank 0 (several nodes), its address and port broadcast by MPI."""
    if world.Get_rank() == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        store = dist.TCPStore(host, 0, world.Get_size(), True, timeout, wait_for_workers=False)
        world.bcast((host, store.port), root=0)
        return store
    host, port = world.bcast(None, root=0)
    return dist.TCPStore(host, port, world.Get_size(), False, timeout)


def mpi_rendezvous(timeout: timedelta = dist.default_pg_timeout) -> tuple[Any, int, int]:
    """(store, rank, world size) from MPI's world (collective)."""
    mpi = MPI()
    world = mpi.COMM_WORLD
    node = world.Split_type(mpi.COMM_TYPE_SHARED)
    one_node = node.Get_size() == world.Get_size()
    node.Free()
    store = _file_store(world, timeout) if one_node else _tcp_store(world, timeout)
    return store, world.Get_rank(), world.Get_size()


def _agree_given(url: str, rank: int, size: int) -> None:
    """A rank or world size the caller gave must be MPI's: else ValueError on every rank (collective)."""
    query = parse_qs(urlparse(url).query)
    wrong = [f"{name}={query[name][0]} (MPI's: {mine})" for name, mine in (("rank", rank), ("world_size", size))
             if query.get(name) and int(query[name][0]) != mine]  # fmt: skip
    mpi = MPI()
    if mpi.COMM_WORLD.allreduce(len(wrong), op=mpi.MAX):
        raise ValueError(f"init_process_group was given a rank or world size not MPI's: {wrong or 'on another rank'}")


def env_or_mpi(torch_env: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """The ``env://`` handler: torch's where its variables are all set, else MPI's rendezvous."""

    def handler(url: str, timeout: timedelta = dist.default_pg_timeout, **kwargs: Any) -> Iterator[Any]:
        if all(os.environ.get(var) for var in ENV):
            yield from torch_env(url, timeout=timeout, **kwargs)
            return
        store, rank, size = mpi_rendezvous(timeout)
        _agree_given(url, rank, size)
        yield store, rank, size
        raise RuntimeError("the env:// rendezvous from MPI cannot be repeated")

    handler.mpigpu = True  # type: ignore[attr-defined]
    return handler


def install() -> None:
    """Make ``env://`` fall back on MPI (starts nothing; idempotent)."""
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if not getattr(handlers.get("env"), "mpigpu", False):
        handlers["env"] = env_or_mpi(handlers["env"])
