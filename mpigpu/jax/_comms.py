"""The communicators mpigpu.jax works on, one pair per user communicator.

Collectives inside compiled JAX code run on XLA's threads, in the order XLA executes them, while the
cross-rank check runs on the thread that traces and lowers the program. Each gets its own duplicate
of the user's communicator, made once, collectively, when a program using it is first lowered:

- ``check``: the trace-time argument check only (the lowering thread);
- ``ctx``: a Context on another duplicate, used only by the FFI handler (backends, data).

So neither can pair with the other, with mpigpu's own eager calls, or with the user's traffic: a
rank that re-lowers alone waits in the check instead of exchanging data with the wrong collective.
A communicator is named inside a compiled program by a small integer key (an FFI attribute),
cached on the communicator itself (MPI attribute caching), so it dies with the communicator.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from mpigpu.core._mpi import MPI, world
from mpigpu.core.errors import ConfigError, MpigpuError
from mpigpu.runtime.context import Context

__all__ = ["Channel", "channel", "comm_key", "ready_channel"]


@dataclass
class Channel:
    """mpigpu.jax's state for one user communicator."""

    user: Any  # the user's communicator (kept alive: its key must not be reused while programs name it)
    check: Any  # duplicate for the trace-time check
    ctx: Context  # context on another duplicate, for the handler's collectives


_lock = threading.Lock()
_users: list[Any] = []  # key -> the user's communicator
_channels: dict[int, Channel] = {}  # key -> channel, once set up
_keyval: list[int] = []  # the MPI attribute key under which a communicator's key is cached


def comm_key(comm: Any = None) -> int:
    """The key naming ``comm`` (default: the world) in compiled programs. Local: no communication."""
    comm = world() if comm is None else comm
    if not hasattr(comm, "Get_attr"):
        raise MpigpuError(f"comm must be an mpi4py communicator, not {type(comm).__name__}")
    with _lock:
        if not _keyval:
            _keyval.append(MPI().Comm.Create_keyval())
        key = comm.Get_attr(_keyval[0])
        if key is None:
            key = len(_users)
            _users.append(comm)
            comm.Set_attr(_keyval[0], key)
        return int(key)


def channel(key: int) -> Channel:
    """The channel of ``key``, set up on first use (collective over the communicator: call it where
    every rank does, in the same order: while lowering)."""
    found = _channels.get(key)
    if found is not None and not found.ctx._closed:
        return found
    if found is not None:  # mpigpu.finalize() closed it: this new program gets a new channel
        found.check.Free()
    user = _users[key]
    mpi = MPI()
    if mpi.Query_thread() < mpi.THREAD_MULTIPLE:
        raise ConfigError(
            "mpigpu.jax needs MPI_THREAD_MULTIPLE: XLA runs the collectives on its own threads while the "
            "program's thread may call MPI. mpi4py asks for it by default; do not set mpi4py.rc.thread_level "
            "lower, and use an MPI library built with thread support."
        )
    check = user.Dup()
    data = user.Dup()
    ch = Channel(user, check, Context.get(data))
    _channels[key] = ch
    return ch


def ready_channel(key: int) -> Channel:
    """The channel of ``key`` from inside the handler: it was set up when the program was lowered."""
    found = _channels.get(key)
    if found is None:
        raise MpigpuError(f"mpigpu.jax: communicator key {key} was never set up in this process (stale compiled code?)")
    if found.ctx._closed:
        raise MpigpuError("mpigpu.jax: mpigpu.finalize() has closed this communicator's backends")
    return found
