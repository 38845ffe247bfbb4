"""Horovod's start-up, topology and process sets, mapped onto MPI communicators.

``init()`` builds mpigpu's context on the job's communicator (collective: it is mpigpu's start-up),
and reads the topology from it: ``local_rank`` is the rank on its node (mpigpu binds GPUs by it),
``cross_rank`` its rank among the processes of its local rank, one per node (its node's index where the
nodes hold as many processes each), all from MPI's nodes (MPI_COMM_TYPE_SHARED). A process set is an MPI
sub-communicator made collectively over the global set's communicator, as ``add_process_set`` is collective in
Horovod with MPI."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from mpigpu.core._mpi import MPI
from mpigpu.horovod._errors import not_initialized
from mpigpu.runtime.context import ANY_THREAD, Context

__all__ = [
    "ProcessSet",
    "add_process_set",
    "comm_of",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_threads_supported",
    "rank",
    "remove_process_set",
    "set_rank_of",
    "shutdown",
    "size",
]


class ProcessSet:
    """A subset of the global ranks that runs collectives among itself (``process_set=`` argument).

    ranks: global ranks (sorted, duplicates removed), or an mpi4py communicator whose processes form the set.
    Registered by ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``."""

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self._given_comm: Any = None
        if hasattr(ranks_or_comm, "Get_rank"):
            self._given_comm = ranks_or_comm
            self.ranks: list[int] | None = None  # the global ranks are known once registered
        else:
            self.ranks = sorted({int(r) for r in ranks_or_comm})
        self.process_set_id: int | None = None
        self.comm: Any = None  # this set's communicator (mpigpu works on its own duplicate); None outside
        self.control: Any = None  # a duplicate of comm for hvd.join's last exchange (who joined last)

    def _check(self) -> None:
        if not _State.initialized:
            raise not_initialized()
        if self.process_set_id is None:
            raise ValueError(
                f"{self!r} is not registered: pass it to hvd.init(process_sets=...) or hvd.add_process_set"
            )

    def size(self) -> int:
        """Number of ranks in the set."""
        self._check()
        assert self.ranks is not None
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set, -1 if it is not in the set."""
        self._check()
        return self.comm.Get_rank() if self.comm is not None else -1

    def included(self) -> bool:
        """True if this process is in the set."""
        self._check()
        return self.comm is not None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _State:
    initialized = False
    comm: Any = None  # the global set's communicator (a duplicate: mpigpu.horovod owns and frees it)
    owned: ClassVar[list[Any]] = []  # communicators to free at shutdown
    sets: ClassVar[dict[int, ProcessSet]] = {}
    # more ProcessSet objects registered with the ranks of an existing set: they share its id (Horovod's)
    aliases: ClassVar[dict[int, list[ProcessSet]]] = {}
    next_id = 1


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Start Horovod's layer on ``comm`` (None: MPI.COMM_WORLD; an mpi4py communicator; or a list of
    world ranks, which form the job: those ranks call init, the others must not). Collective over the
    job. ``process_sets``: ProcessSets to register now (every rank passes the same), or "dynamic"
    (accepted: sets can always be added later). A second call does nothing."""
    if _State.initialized:
        return
    mpi = MPI()
    world = mpi.COMM_WORLD
    if comm is None:
        base = world.Dup()
    elif hasattr(comm, "Get_rank"):
        base = comm.Dup()
    else:
        ranks = [int(r) for r in comm]
        if world.Get_rank() not in ranks:
            raise ValueError(f"rank {world.Get_rank()} called hvd.init(comm={ranks}) but is not in that list")
        group = world.Get_group().Incl(ranks)
        base = world.Create_group(group)  # collective over the listed ranks only
        group.Free()
    _State.comm = base
    global_process_set.control = base.Dup()
    _State.owned = [base, global_process_set.control]
    _any_thread(Context.get(base))  # mpigpu's start-up (collective): topology, GPU binding, backends
    global_process_set.ranks = _global_ranks(base)
    global_process_set.comm = base
    _State.sets = {0: global_process_set}
    _State.next_id = 1
    _State.initialized = True
    if process_sets is not None and not isinstance(process_sets, str):
        for process_set in process_sets:
            add_process_set(process_set)


def _any_thread(ctx: Context) -> None:
    """Let any thread call on ``ctx``'s communicator, as Horovod lets any thread enqueue: with CUDA tensors
    autograd runs the backward of ``hvd.allreduce`` (itself an allreduce) on its own device thread while the
    main thread waits in ``backward()``. Calls are still issued one at a time, in the order they are made;
    the cross-rank check raises on every rank if two ranks' orders pair different shapes or collectives."""
    ctx.owner = ANY_THREAD


def _global_ranks(comm: Any) -> list[int]:
    """The world ranks of ``comm``'s processes, in its rank order."""
    mpi = MPI()
    world_group, group = mpi.COMM_WORLD.Get_group(), comm.Get_group()
    try:
        return [int(r) for r in mpi.Group.Translate_ranks(group, list(range(comm.Get_size())), world_group)]
    finally:
        group.Free()
        world_group.Free()


def shutdown() -> None:
    """Free the communicators made by init and add_process_set (MPI itself stays up). Idempotent."""
    if not _State.initialized:
        return
    _State.initialized = False
    for process_set in [*_State.sets.values(), *(a for same in _State.aliases.values() for a in same)]:
        if process_set is not global_process_set:
            process_set.process_set_id, process_set.comm, process_set.control = None, None, None
    _State.aliases = {}
    global_process_set.comm = global_process_set.control = None
    if not MPI().Is_finalized():
        for comm in _State.owned:  # the layer's queued calls finish before their communicators go
            ctx = Context.existing(comm)
            if ctx is not None:
                ctx.wait_async()
        for comm in _State.owned:
            comm.Free()
    _State.owned, _State.sets, _State.comm = [], {}, None


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _State.initialized


def _context() -> Context:
    if not _State.initialized:
        raise not_initialized()
    return Context.get(_State.comm)


def size() -> int:
    """Number of processes in the job."""
    return _context().size


def rank() -> int:
    """This process's rank in the job."""
    return _context().rank


def local_size() -> int:
    """Number of processes on this node (a virtual node of MPIGPU_NODE_SIZE ranks where set)."""
    layout = _context().layout
    assert layout is not None
    return layout.local_size


def local_rank() -> int:
    """This process's rank on its node: pin the GPU with ``torch.cuda.set_device(hvd.local_rank())``
    (mpigpu binds rank to GPU the same way: node-local rank modulo visible GPUs)."""
    layout = _context().layout
    assert layout is not None
    return layout.local_rank


def cross_size() -> int:
    """Number of nodes that hold a process of this ``local_rank`` (Horovod's cross communicator): the number
    of nodes where every node holds as many processes; at 2+1, 2 for the first process of each node and 1
    for the second of the first node."""
    layout = _context().layout
    assert layout is not None
    return sum(1 for n in layout.node_sizes if n > layout.local_rank)


def cross_rank() -> int:
    """This process's rank among the processes of its ``local_rank`` on every node, in node order: its node's
    index where every node holds as many processes."""
    layout = _context().layout
    assert layout is not None
    return sum(1 for n in layout.node_sizes[: layout.node_index] if n > layout.local_rank)


def mpi_threads_supported() -> bool:
    """True if MPI runs at MPI_THREAD_MULTIPLE (mpigpu's background thread needs it)."""
    if not _State.initialized:
        raise not_initialized()
    mpi = MPI()
    return bool(mpi.Query_thread() >= mpi.THREAD_MULTIPLE)


def _registered(process_set: ProcessSet) -> bool:
    """Whether ``process_set`` is registered: the set of its id, or one that shares the id."""
    number = process_set.process_set_id
    if number is None:
        return False
    return _State.sets.get(number) is process_set or any(a is process_set for a in _State.aliases.get(number, []))


def comm_of(process_set: ProcessSet) -> Any:
    """The communicator collectives on ``process_set`` run on; ValueError if this rank is outside it."""
    if not _State.initialized:
        raise not_initialized()
    if not _registered(process_set):
        raise ValueError(f"{process_set!r} is not registered: call hvd.add_process_set first")
    if process_set.comm is None:
        raise ValueError(f"rank {rank()} is not in {process_set!r}: only its ranks may call collectives on it")
    return process_set.comm


def set_rank_of(process_set: ProcessSet, root_rank: int) -> int:
    """The rank within ``process_set`` of the job's rank ``root_rank``: Horovod's ``root_rank`` is a rank of
    the job (``hvd.rank()``), in a process set too. ValueError if that rank is not in the set."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise ValueError(f"root_rank must be an integer rank of the job, not {type(root_rank).__name__}")
    world = global_process_set.ranks or []
    members = [world.index(r) for r in process_set.ranks or []]  # the set's ranks as ranks of the job
    if root_rank not in members:
        raise ValueError(f"root_rank {root_rank} is not a rank of {process_set!r} (ranks of the job: {members})")
    return members.index(root_rank)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set and build its communicator. Collective: every rank of the job calls it
    with the same ranks, in the same order as the other add/remove calls (as in Horovod with MPI)."""
    if not _State.initialized:
        raise not_initialized()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered")
    base = _State.comm
    mpi = MPI()
    if process_set._given_comm is not None:
        member = process_set._given_comm != mpi.COMM_NULL
        process_set.ranks = sorted(
            r for r in base.allgather(_global_ranks(base)[base.Get_rank()] if member else None) if r is not None
        )
    ranks = process_set.ranks
    assert ranks is not None
    everyone = base.allgather(ranks)
    if any(other != ranks for other in everyone):
        raise ValueError(f"add_process_set: the ranks differ between processes: {everyone}")
    known = set(global_process_set.ranks or [])
    if not set(ranks) <= known:
        raise ValueError(f"add_process_set: ranks {ranks} must be a subset of {sorted(known)}")
    same = next((other for other in _State.sets.values() if other.ranks == ranks), None)
    if same is not None:  # the ranks of a registered set (the global one, at one rank): share its id
        process_set.process_set_id, process_set.comm, process_set.control = (
            same.process_set_id, same.comm, same.control,
        )  # fmt: skip
        _State.aliases.setdefault(same.process_set_id, []).append(process_set)  # type: ignore[arg-type]
        return process_set
    world_ranks = global_process_set.ranks or []
    base_group = base.Get_group()
    group = base_group.Incl([world_ranks.index(r) for r in ranks])
    sub = base.Create(group)  # collective over the whole job
    group.Free()
    base_group.Free()
    process_set.comm = None if sub == mpi.COMM_NULL else sub
    if process_set.comm is not None:
        process_set.control = sub.Dup()
        _State.owned += [sub, process_set.control]
        _any_thread(Context.get(sub))  # mpigpu's start-up on the set (collective over its ranks)
    process_set.process_set_id = _State.next_id
    _State.sets[_State.next_id] = process_set
    _State.next_id += 1
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its communicator (collective over the job, as add is).
    Returns False if it was not registered. The global set cannot be removed."""
    if not _State.initialized:
        raise not_initialized()
    if process_set is global_process_set:
        raise ValueError("the global process set cannot be removed")
    if not _registered(process_set) or process_set.process_set_id == 0:
        return False
    process_set = _State.sets[process_set.process_set_id]  # type: ignore[index]  # an alias removes its set
    for alias in _State.aliases.pop(process_set.process_set_id, []):  # type: ignore[arg-type]
        alias.comm, alias.control, alias.process_set_id = None, None, None
    _State.comm.Barrier()  # collective like add_process_set: no rank frees while another still uses it
    del _State.sets[process_set.process_set_id]  # type: ignore[arg-type]
    comm, control = process_set.comm, process_set.control
    process_set.comm, process_set.control, process_set.process_set_id = None, None, None
    if comm is not None:
        for owned in (control, comm):
            _State.owned.remove(owned)
            owned.Free()
    return True
