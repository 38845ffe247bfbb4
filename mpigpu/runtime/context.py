"""Per-communicator state: layout, GPU, capabilities, backends, tuning table, watchdog.

Created collectively the first time a communicator is used (every rank reaches that point in the
same call). Everything that decides a backend is made identical on every rank here, so ``auto``
picks the same path everywhere.

Isolation: mpigpu never communicates on the user's communicator. The context duplicates it once
(``comm.Dup()``, collectively, at creation) and every collective mpigpu issues runs on that
duplicate, so the user's own collectives (``comm.allreduce``, ``comm.Split_type``) can never pair
with mpigpu's, also while ``allreduce_async`` calls are queued.

Lifetime: the context is cached on the user's communicator as an MPI attribute whose delete
callback closes it, so ``comm.Free()`` frees the context and its duplicate, and a new communicator
that MPI gives the same handle gets a new context. ``finalize()`` (at exit) closes the rest.

One thread per communicator: the first thread that makes an mpigpu call on a communicator owns it;
a call from another thread is refused (see ``Context.enter``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from mpigpu.backends import BACKEND_NAMES, Availability, Backend, backend_class
from mpigpu.core import timeline
from mpigpu.core._mpi import MPI, LibraryInfo, library_info, world
from mpigpu.core.config import AGREED, DEFAULT_STALL_S, DEFAULT_TIMEOUT_S, ENV_VARS, Settings, disagreement
from mpigpu.core.errors import BackendUnavailable, ConfigError, DeviceError, InvalidArgument, MismatchError, MpigpuError
from mpigpu.core.typed import allgather_ints, allgather_text, allreduce_int
from mpigpu.job.check import Signature, check_signature, mark_raised_everywhere
from mpigpu.job.check_board import Board, open_board
from mpigpu.job.creation import exclusive
from mpigpu.job.detect import CudaAwareness, NcclInfo, detect_cuda_awareness, detect_nccl
from mpigpu.job.device import GpuInfo, map_device
from mpigpu.job.failsafe import Watchdog, install_default_handler
from mpigpu.job.mpi_board import open_mpi_board
from mpigpu.job.peers import NodePeers, NodeProgress, node_peers
from mpigpu.job.timeline_start import start_timeline
from mpigpu.job.topology import Layout, build_layout
from mpigpu.runtime.tuning import load_tuning

__all__ = ["ANY_THREAD", "Context", "announce_rejection", "finalize"]

_get_ident = threading.get_ident  # bound once: every call's ``enter`` asks

ANY_THREAD = -1  # Context.owner of a communicator whose single user orders its calls itself (Averager)


class Context:
    """Everything mpigpu knows about one communicator."""

    _live: ClassVar[dict[int, tuple[Any, Context]]] = {}  # id(ctx) -> (user communicator, ctx), creation order
    _lock: ClassVar[threading.Lock] = threading.Lock()  # guards _keyval and _creating
    _creating: ClassVar[dict[int, threading.Lock]] = {}  # communicator handle -> lock held while creating
    _keyval: ClassVar[int | None] = None  # MPI attribute key the contexts are cached under
    # id(communicator object) -> (that object, its ctx): the lookup on every call, cheaper than
    # Get_attr; the entries of a context go when it closes
    _known: ClassVar[dict[int, tuple[Any, Context]]] = {}
    _world: ClassVar[Context | None] = None  # the world's context: ``get()`` with no communicator, the usual call
    _made: ClassVar[int] = 0  # contexts made so far in this process

    def __init__(self, comm: Any) -> None:
        settings, error = _local_settings()
        # its number in the order contexts are made (collectively: the same on every rank), which names
        # its communicator on the timeline
        self.serial = Context._made
        Context._made += 1
        self.calls = 0  # mpigpu calls made on this communicator (Context.enter): the stall report names them
        self.size = comm.Get_size()  # also the size of its duplicate, self.comm
        # an invalid variable (settings None) fails start-up on every rank, watched with the defaults
        timeout, stall = (settings.timeout, settings.stall) if settings else (DEFAULT_TIMEOUT_S, DEFAULT_STALL_S)
        self.watchdog = Watchdog(timeout, stall, self._where, self._gone)
        self.peers: NodePeers | None = None  # this communicator's ranks on this node, watched while waiting
        self.comm: Any = None
        self.layout: Layout | None = None
        self._closed = False
        self.async_worker: Any = None  # mpigpu.calls.handles.Worker, started by the first allreduce_async needing it
        self.owner: int | None = None  # the thread that issues this communicator's calls (Context.enter)
        self._violation: str | None = None  # set once a second thread has called: every call is refused
        self._calls = threading.RLock()  # held by the owner during a call; a refusal waits for it
        self._known_ids: list[int] = []  # its keys in Context._known
        self.check_board: Board | None = None
        self.progress: NodeProgress | None = None  # calls begun by this node's ranks, where no board holds them
        label = f"mpigpu start-up (the first mpigpu call on a communicator of {self.size} ranks; collective)"
        with self.watchdog.watch(label), exclusive(comm):  # one creation at a time, in the same order everywhere
            # mpigpu's own duplicate: nothing the user does on ``comm`` can pair with its collectives
            self.comm = comm.Dup()
            try:
                self.settings = _agreed_settings(self.comm, settings, error)
                self._start(self.comm)
            except BaseException:
                self.close()
                raise

    def _start(self, comm: Any) -> None:
        self.rank = comm.Get_rank()
        self.mpi_lib: LibraryInfo = library_info()
        self.layout: Layout = build_layout(comm, self.settings.node_size)
        # MPIGPU_TIMELINE (agreed): collective where set, else nothing; each rank's file names its node
        start_timeline(comm, self.settings, self.layout.node_index)
        self.peers = node_peers(comm, self.layout.phys_comm)
        # The cross-rank check through node-shared memory when every rank is on one (unsplit) node;
        # otherwise through one exchange among node leaders or all ranks (mpi_board), or, past its size,
        # MPI_Allreduce (None).
        # Every later check on self.comm finds it (check_board.board_for).
        if self.settings.check:  # agreed on every rank: open_board is collective
            self.check_board = open_board(comm, None if self.layout.virtual else self.layout.phys_comm)
            if self.check_board is None and self.size > 1:
                self.check_board = open_mpi_board(comm, self.layout)
        # the stall report's numbers, where no board holds them (the MPI board's reached() is None)
        if self.check_board is None or self.check_board.reached() is None:
            self.progress = NodeProgress(comm, self.layout.phys_comm)
        self.gpu: GpuInfo | None = map_device(
            self.layout, self.settings.allow_shared_gpu, self.settings.devices_per_rank
        )
        has_gpu = self.gpu is not None
        self.all_have_gpus: bool = bool(allreduce_int(comm, int(has_gpu), "min"))
        self.any_has_gpus: bool = bool(allreduce_int(comm, int(has_gpu), "max"))

        local = detect_cuda_awareness(comm, self.mpi_lib, self.settings.cuda_aware)
        agreed = bool(allreduce_int(comm, int(local.aware), "min"))
        if local.aware and not agreed:
            local = CudaAwareness(False, "not CUDA-aware on every rank", local.findings)
        self.cuda_aware: CudaAwareness = local

        nccl = detect_nccl(1 if self.all_have_gpus else 0)
        if nccl.available and not allreduce_int(comm, int(nccl.available), "min"):
            nccl = NcclInfo(False, nccl.version, "NCCL does not load on every rank")
        self.nccl: NcclInfo = nccl

        self._backends: dict[str, Backend] = {}
        self.plan_cache: dict[tuple[Any, ...], Any] = {}  # mpigpu.runtime.plan.choose_cached
        self.availability: dict[str, Availability] = {}
        for name in BACKEND_NAMES:  # collective on every rank, in the same order
            self.availability[name] = self._probe(name)

        self.tuning = load_tuning(self)

    def _probe(self, name: str) -> Availability:
        try:
            local = backend_class(name).probe(self)
        except MpigpuError as exc:
            local = Availability(False, str(exc))
        agreed = bool(allreduce_int(self.comm, int(local.ok), "min"))
        if local.ok and not agreed:
            return Availability(False, "not available on every rank")
        return local

    # -- lookup -----------------------------------------------------------------------------------
    @classmethod
    def get(cls, comm: Any = None) -> Context:
        """The context of ``comm`` (default: the world), created collectively on first use."""
        if comm is None:
            ctx = cls._world
            if ctx is not None and not ctx._closed:
                return ctx
            cls._world = ctx = cls.get(world())
            return ctx
        known = cls._known.get(id(comm))
        if known is not None and known[0] is comm and not known[1]._closed:
            return known[1]  # a communicator object seen before (held there, so its id is not reused)
        ctx = cls._lookup(comm)
        if ctx is None:
            # One lock per communicator, not one for all: creation is collective, and two threads
            # creating the contexts of two communicators (one each) must not wait for each other.
            with cls._lock:
                if cls._keyval is None:
                    # Registered after mpi4py's own exit handler, so it runs first: resources are
                    # freed while MPI is still initialised.
                    atexit.register(finalize)
                    cls._keyval = MPI().Comm.Create_keyval(delete_fn=_delete_callback)
                creating = cls._creating.setdefault(int(comm.handle), threading.Lock())
            with creating:
                ctx = cls._lookup(comm)
                if ctx is None:
                    ctx = cls._create(comm)
        cls._known[id(comm)] = (comm, ctx)
        ctx._known_ids.append(id(comm))
        return ctx

    @classmethod
    def _lookup(cls, comm: Any) -> Context | None:
        if cls._keyval is not None:
            try:
                ctx = comm.Get_attr(cls._keyval)
            except MPI().Exception:
                pass  # COMM_NULL: reported below
            else:
                return None if ctx is None or ctx._closed else ctx
        if comm == MPI().COMM_NULL:
            raise InvalidArgument("comm is MPI.COMM_NULL (a freed communicator?): pass a valid communicator")
        return None

    @classmethod
    def _create(cls, comm: Any) -> Context:
        assert cls._keyval is not None
        ctx = cls(comm)
        comm.Set_attr(cls._keyval, ctx)  # replacing a closed context runs its delete callback (a no-op)
        ctx.comm.Set_attr(cls._keyval, ctx)  # mpigpu's commands pass ctx.comm back in: the same context
        cls._live[id(ctx)] = (comm, ctx)
        return ctx

    # -- the one-thread rule ------------------------------------------------------------------------
    def enter(self, what: str) -> None:
        """Start a call on this communicator from the current thread (pair with ``leave``).

        The first thread to call owns the communicator. A call from any other thread is refused with
        InvalidArgument, and from then on every call on this communicator is refused on this rank:
        calls issued by two threads reach MPI in a different order on each rank and would pair with
        the wrong calls of the other ranks. Each refusal joins the cross-rank check with its error
        (between two calls of the owner, after the queued ones), so the other ranks raise
        MismatchError instead of waiting or pairing their data with another call."""
        if _get_ident() == self.owner and self._violation is None:  # the owner's call: the usual one
            self.calls += 1
            if self.progress is not None:
                self.progress.counts[self.progress.slot] = self.calls
            self._calls.acquire()
            return
        if self._on_worker():  # a task queued by the owner: the queue already orders it
            return
        self.calls += 1
        if self.progress is not None:
            self.progress.counts[self.progress.slot] = self.calls
        ident = threading.get_ident()
        owner = self.owner
        if owner != ident and owner != ANY_THREAD:
            if owner is None:
                with self._calls:
                    if self.owner is None:
                        self.owner = ident
                owner = self.owner
            if owner != ident and self._violation is None:
                self._violation = (
                    f"{what} was called from thread {threading.current_thread().name!r}, but this communicator's "
                    f"calls are issued by another thread (the first to call mpigpu on it)"
                )
        if self._violation is not None:
            self._refuse(what)
        self._calls.acquire()

    def leave(self) -> None:
        """End a call started with ``enter``."""
        worker = self.async_worker  # ``_on_worker``, inlined: every call comes here
        if worker is None or not worker.runs_here():
            self._calls.release()

    def _on_worker(self) -> bool:
        """True on this communicator's background thread (``mpigpu.calls.handles.Worker``): a call made by one
        of its queued tasks belongs to the call that queued it, which held the communicator then."""
        worker = self.async_worker
        return worker is not None and worker.runs_here()

    def _gone(self) -> str:
        """The ranks of this communicator on this node whose processes have ended ("" while none has;
        read by the watchdog's thread while a call waits)."""
        peers = self.peers
        if peers is None:
            return ""
        return ", ".join(f"rank {rank} (pid {pid}, this node)" for rank, pid in peers.gone())

    def _where(self) -> str:
        """Which call this rank waits in and which ranks have not reached it (read by the watchdog's
        thread: the check board's numbers, where there is one; never a guess where there is not)."""
        text = f"mpigpu call {self.calls} on its communicator of {self.size} ranks"
        board = getattr(self, "check_board", None)
        if self.calls == 0:
            return f"{text} (start-up); which ranks have not reached it is not known here"
        reached = None if board is None else board.reached()
        if board is None or reached is None:
            return f"{text}; {self._where_on_this_node()}"
        numbers = ", ".join(map(str, reached))
        behind = [r for r, k in enumerate(reached) if k < board.k]
        ahead = [r for r, k in enumerate(reached) if k > board.k]
        parts = [f"{_ranks(behind)} not reached argument check {board.k}, where this rank is"] if behind else []
        parts += [f"{_ranks(ahead)} made more calls"] if ahead else []
        if not parts:
            parts = [f"every rank has reached argument check {board.k}"]
        return f"{text}; {'; '.join(parts)} (checks by rank: {numbers})"

    def _where_on_this_node(self) -> str:
        """The ranks of this node that have not reached this rank's call, from the node's call counts
        (ranks on other nodes are named by their own node's reports)."""
        layout, progress = self.layout, self.progress
        if layout is None or progress is None:
            return "which ranks have not reached it is not known here"
        node = f"node {layout.node_index} (host {layout.hostnames[self.rank]})"
        behind, ahead = progress.behind(self.calls), progress.ahead(self.calls)
        parts = [f"{_ranks(behind)} not reached it"] if behind else []
        parts += [f"{_ranks(ahead)} made more calls"] if ahead else []
        if not parts:
            parts = [f"every rank of this node ({_on(progress.ranks)}) has reached it"]
        others = "; ranks on other nodes are named by their nodes' reports" if layout.num_nodes > 1 else ""
        return f"on this rank's {node}, {', '.join(parts)}{others}"

    def _refuse(self, what: str) -> None:
        assert self._violation is not None
        error = InvalidArgument(
            f"{what} refused: {self._violation}. mpigpu issues a communicator's collectives in the order its "
            "calls are made, so calls from two threads would pair with different calls on each rank; this "
            "communicator can no longer be used. Issue all calls on a communicator from one thread, or give "
            "each thread its own communicator (e.g. `comm = MPI.COMM_WORLD.Dup()`, created on every rank in "
            "the same order, then `allreduce(x, comm=comm)`)."
        )
        with self._calls:  # between two calls of the owner, after its queued ones: the same place on every rank
            with contextlib.suppress(MpigpuError):
                self.wait_async()
            announce_rejection(self, error)
        raise error

    # -- GPU --------------------------------------------------------------------------------------
    def activate_gpu(self) -> Any:
        """Make this rank's GPU current on the calling thread; return its cuda.core Device."""
        if self.gpu is None:
            raise BackendUnavailable("this rank has no GPU")
        from mpigpu.core._cuda import set_device

        return set_device(self.gpu.index)

    def require_own_gpu(self, view: Any) -> None:
        """Refuse a GPU array that is not on this rank's GPU (DeviceError saying where to allocate)."""
        if not view.on_device:
            return
        if self.gpu is None:
            raise DeviceError("x is a GPU array, but this rank has no GPU bound (no GPU was visible at start-up)")
        if view.device != self.gpu.index:
            raise DeviceError(
                f"x is on GPU {view.device}, but rank {self.rank} is bound to {self.gpu.describe()}. Allocate on "
                "the rank's GPU: `torch.cuda.set_device(mpigpu.select_device().index)`, "
                "`cupy.cuda.Device(mpigpu.select_device().index).use()`, or for JAX `mpigpu.jax.init()` before "
                "JAX starts (it makes the rank's GPU JAX's default device)."
            )

    # -- ordering -------------------------------------------------------------------------------
    @classmethod
    def existing(cls, comm: Any) -> Context | None:
        """The context mpigpu made for ``comm``, or None (local; never makes one)."""
        known = cls._known.get(id(comm))
        return known[1] if known is not None and known[0] is comm else None

    def wait_async(self) -> None:
        """Block until the calls allreduce_async queued on this communicator have run, so that a
        following collective reaches MPI after them, in the same order on every rank."""
        if self.async_worker is not None:
            self.async_worker.drain()

    # -- backends ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def changed_settings(self, **fields: Any) -> Iterator[None]:
        """These settings fields for this communicator only, for the block (benchmarks and tests that compare
        settings in one job; every rank must enter the block at the same call, as with any agreed setting)."""
        saved = self.settings
        self.settings = dataclasses.replace(saved, **fields)
        try:
            yield
        finally:
            self.settings = saved

    def created(self, name: str) -> bool:
        """Whether backend ``name`` exists already (``backend`` would not create it)."""
        return name in self._backends

    def backend(self, name: str) -> Backend:
        """The backend instance for ``name``, created on first use (collectively)."""
        instance = self._backends.get(name)
        if instance is not None:
            return instance
        available = self.availability.get(name)
        if available is None:
            backend_class(name)  # raises the "unknown backend" error
        assert available is not None
        if not available.ok:
            raise BackendUnavailable(f"backend {name!r} is not available here: {available.reason}")
        with exclusive(self.comm):  # it may make communicators or shared windows
            instance = backend_class(name)(self)
        self._backends[name] = instance
        return instance

    def close(self) -> None:
        """Free every backend and communicator this context holds, its duplicate included
        (idempotent; collective: every rank closes its contexts in the same order)."""
        if self._closed:
            return
        self._closed = True
        Context._live.pop(id(self), None)
        for key in self._known_ids:
            known = Context._known.get(key)
            if known is not None and known[1] is self:
                del Context._known[key]
        if self.async_worker is not None:  # queued calls finish before their backends are freed
            self.async_worker.close()
            self.async_worker = None
        try:
            if self.comm is None or MPI().Is_finalized():
                self._free()  # nothing collective left to order (a failed start-up, or after MPI_Finalize)
                return
            # watched, and in the same order on every rank as the creations (see exclusive)
            with self.watchdog.watch("mpigpu teardown (closing a context; collective)"), exclusive(self.comm):
                self._free()
        finally:
            self.watchdog.stop()

    def _free(self) -> None:
        getattr(self, "plan_cache", {}).clear()  # call records hold launches bound to the backends freed next
        group = self.__dict__.pop("device_group", None)  # several devices per process (mpigpu.multi.group)
        if group is not None:
            try:
                group.close()
            except Exception as exc:  # report, keep closing the rest
                sys.stderr.write(f"mpigpu: closing the per-device state failed: {exc}\n")
        for instance in reversed(list(getattr(self, "_backends", {}).values())):
            try:
                instance.close()
            except Exception as exc:  # report, keep closing the rest
                sys.stderr.write(f"mpigpu: closing backend {instance.name} failed: {exc}\n")
        getattr(self, "_backends", {}).clear()
        if self.check_board is not None:
            with contextlib.suppress(Exception):
                if not MPI().Is_finalized():
                    self.check_board.close()
            self.check_board = None
        if self.progress is not None:
            with contextlib.suppress(Exception):
                if not MPI().Is_finalized():
                    self.progress.close()
            self.progress = None
        if self.layout is not None:
            self.layout.close()
        comm, self.comm = self.comm, None
        if comm is not None:
            with contextlib.suppress(Exception):
                if not MPI().Is_finalized():
                    comm.Free()


def _on(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def _ranks(ranks: list[int]) -> str:
    return f"{_on(ranks)} {'has' if len(ranks) == 1 else 'have'}"


_TEST_VARIABLES = ("MPIGPU_REQUIRE_GPU",)  # read by the test suite, not by mpigpu


def announce_rejection(ctx: Context, exc: Exception) -> None:
    """Join the cross-rank check with this rank's own error, so every other rank raises MismatchError
    naming it instead of waiting (collective; this rank then raises its own error)."""
    if ctx.settings.check:
        # watched: a rank that never arrives would leave this one waiting in the check
        with contextlib.suppress(MismatchError), ctx.watchdog.watch("allreduce (reporting an invalid call)"):
            check_signature(ctx.comm, Signature(0, 0, 0, 0, 0, error=f"{type(exc).__name__}: {exc}"))
        mark_raised_everywhere(ctx.comm, exc)  # every other rank raises MismatchError for this call


def _local_settings() -> tuple[Settings | None, ConfigError | None]:
    try:
        return Settings.from_env(), None
    except ConfigError as exc:
        return None, exc


def _agreed_settings(comm: Any, settings: Settings | None, error: ConfigError | None) -> Settings:
    """Collective: a bad MPIGPU_* value on any rank fails start-up on every rank with the same
    ConfigError (naming the rank, the variable and its value), and so does a setting that changes
    which collectives run (Settings.agreed) when it differs between ranks, instead of leaving the
    others waiting in the next collective. A rank whose settings failed still takes part in every
    exchange here."""
    rows = _gather_agreed(comm, settings)
    if any(failed for failed, _ in rows):
        mine = "" if error is None else str(error) or type(error).__name__  # empty: this rank's settings are valid
        raise mark_raised_everywhere(comm, _start_up_failure(allgather_text(comm, mine)), same_text=True)
    assert settings is not None
    problem = disagreement([agreed for _, agreed in rows])
    if problem is not None:
        raise mark_raised_everywhere(comm, ConfigError(problem), same_text=True)
    if settings.abort_on_exception:
        install_default_handler()
    unknown = sorted(
        k for k in os.environ if k.startswith("MPIGPU_") and k not in ENV_VARS and k not in _TEST_VARIABLES
    )
    if unknown and comm.Get_rank() == 0:  # a misspelt MPIGPU_TIMEOUT would otherwise leave timeouts off, silently
        sys.stderr.write(f"mpigpu: ignoring unknown variable(s) {', '.join(unknown)}; known: {', '.join(ENV_VARS)}\n")
    return settings


def _start_up_failure(texts: list[str]) -> ConfigError:
    """The one ConfigError every rank raises when the settings of some failed (``texts``: each rank's
    message, empty where they were valid): that message as it is where every rank has it, else each
    failing rank's with its rank."""
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(texts):
        if text:
            by_text.setdefault(text, []).append(rank)
    if len(by_text) == 1 and all(texts):
        return ConfigError(texts[0])
    failed = sorted(rank for ranks in by_text.values() for rank in ranks)
    lines = "\n  ".join(f"{_on(ranks)}: {text}" for text, ranks in by_text.items())
    return ConfigError(
        f"mpigpu start-up did not run: {_on(failed)} failed.\n  {lines}\nSet the variable alike in the environment "
        "of every rank (the launcher's -env/-x options, the job script)."
    )


def _gather_agreed(comm: Any, settings: Settings | None) -> list[tuple[bool, tuple[tuple[str, object], ...]]]:
    """Every rank's (failed, ``Settings.agreed()``), in one MPI_Allgather of integers (collective): -1
    for unset; a rank whose settings failed (None) sends its flag and -1s. Every agreed value is within
    INT_RANGES or a 0/1 flag, so it fits an int64."""
    mine = [-1] * len(AGREED) if settings is None else [-1 if v is None else int(v) for _, v in settings.agreed()]  # type: ignore[call-overload]
    rows = allgather_ints(comm, [int(settings is None), *mine])
    return [
        (bool(row[0]), tuple((name, None if v == -1 else v) for name, v in zip(AGREED, row[1:], strict=True)))
        for row in rows
    ]


def _delete_callback(comm: Any, keyval: int, ctx: Context) -> None:
    """MPI calls this when the user's communicator is freed (``comm.Free()``, collective on every
    rank) or its attribute deleted: close the context. Closing runs collectives only on the
    context's own communicators, which every rank frees in this same call, so it cannot wait for
    anything but the other ranks' identical close."""
    try:
        ctx.close()
    except Exception as exc:  # an exception here would surface as an MPI error from comm.Free()
        sys.stderr.write(f"mpigpu: closing the context of a freed communicator failed: {exc}\n")


def finalize() -> None:
    """Free all pinned memory, device buffers, NCCL communicators and IPC handles mpigpu holds.

    Called automatically at exit; call it earlier to release resources before MPI_Finalize.
    Collective: contexts are closed in the order they were created, the same on every rank. With
    MPIGPU_TIMELINE set, this rank's timeline file is written first."""
    if timeline.on:
        timeline.flush()
    for comm, ctx in list(Context._live.values()):
        if Context._keyval is not None:
            with contextlib.suppress(Exception):  # the attribute's delete callback closes the context
                if comm.Get_attr(Context._keyval) is ctx:
                    comm.Delete_attr(Context._keyval)
        ctx.close()
