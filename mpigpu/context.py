"""Per-communicator state: layout, GPU, capabilities, backends, tuning table, watchdog.

Created collectively the first time a communicator is used (every rank reaches that point in the
same call), then cached. Everything that decides a backend is made identical on every rank here,
so ``auto`` picks the same path everywhere.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, ClassVar

from mpigpu._mpi import MPI, LibraryInfo, library_info, world
from mpigpu.backends import BACKEND_NAMES, Availability, Backend, backend_class
from mpigpu.check import agree
from mpigpu.config import ENV_VARS, Settings
from mpigpu.detect import CudaAwareness, NcclInfo, detect_cuda_awareness, detect_nccl
from mpigpu.device import GpuInfo, map_device
from mpigpu.errors import BackendUnavailable, ConfigError, MpigpuError
from mpigpu.failsafe import Watchdog, install_default_handler
from mpigpu.topology import Layout, build_layout

__all__ = ["Context", "finalize"]


class Context:
    """Everything mpigpu knows about one communicator."""

    _by_handle: ClassVar[dict[int, Context]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, comm: Any) -> None:
        settings, error = _local_settings()
        self.watchdog = Watchdog(settings.timeout if settings is not None else 0.0)
        label = f"mpigpu start-up (the first mpigpu call on a communicator of {comm.Get_size()} ranks; collective)"
        with self.watchdog.watch(label):
            self.settings = _agreed_settings(comm, settings, error)
            self._start(comm)

    def _start(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.mpi_lib: LibraryInfo = library_info()
        self.layout: Layout = build_layout(comm, self.settings.node_size)
        self.gpu: GpuInfo | None = map_device(self.layout, self.settings.allow_shared_gpu)
        has_gpu = self.gpu is not None
        self.all_have_gpus: bool = bool(comm.allreduce(int(has_gpu), op=MPI().MIN))
        self.any_has_gpus: bool = bool(comm.allreduce(int(has_gpu), op=MPI().MAX))

        local = detect_cuda_awareness(comm, self.mpi_lib, self.settings.cuda_aware)
        agreed = bool(comm.allreduce(int(local.aware), op=MPI().MIN))
        if local.aware and not agreed:
            local = CudaAwareness(False, "not CUDA-aware on every rank", local.findings)
        self.cuda_aware: CudaAwareness = local

        nccl = detect_nccl(1 if self.all_have_gpus else 0)
        if nccl.available and not comm.allreduce(int(nccl.available), op=MPI().MIN):
            nccl = NcclInfo(False, nccl.version, "NCCL does not load on every rank")
        self.nccl: NcclInfo = nccl

        self._backends: dict[str, Backend] = {}
        self.plan_cache: dict[tuple[Any, ...], Any] = {}  # mpigpu.plan.choose_cached
        self.async_worker: Any = None  # mpigpu.handles.Worker, started by the first allreduce_async needing it
        self._closed = False
        self.availability: dict[str, Availability] = {}
        for name in BACKEND_NAMES:  # collective on every rank, in the same order
            self.availability[name] = self._probe(name)

        from mpigpu.plan import load_tuning

        self.tuning = load_tuning(self)

    def _probe(self, name: str) -> Availability:
        try:
            local = backend_class(name).probe(self)
        except MpigpuError as exc:
            local = Availability(False, str(exc))
        agreed = bool(self.comm.allreduce(int(local.ok), op=MPI().MIN))
        if local.ok and not agreed:
            return Availability(False, "not available on every rank")
        return local

    # -- lookup -----------------------------------------------------------------------------------
    @classmethod
    def get(cls, comm: Any = None) -> Context:
        """The context of ``comm`` (default: the world), created collectively on first use."""
        comm = world() if comm is None else comm
        handle = int(comm.handle) if hasattr(comm, "handle") else id(comm)
        ctx = cls._by_handle.get(handle)
        if ctx is None or ctx._closed:
            with cls._lock:
                ctx = cls._by_handle.get(handle)
                if ctx is None or ctx._closed:
                    if not cls._by_handle:
                        # Registered after mpi4py's own exit handler, so it runs first: resources
                        # are freed while MPI is still initialised.
                        atexit.register(finalize)
                    ctx = cls(comm)
                    cls._by_handle[handle] = ctx
        return ctx

    # -- GPU --------------------------------------------------------------------------------------
    def activate_gpu(self) -> Any:
        """Make this rank's GPU current on the calling thread; return its cuda.core Device."""
        if self.gpu is None:
            raise BackendUnavailable("this rank has no GPU")
        from mpigpu._cuda import set_device

        return set_device(self.gpu.index)

    # -- ordering -------------------------------------------------------------------------------
    def wait_async(self) -> None:
        """Block until the calls allreduce_async queued on this communicator have run, so that a
        following collective reaches MPI after them, in the same order on every rank."""
        if self.async_worker is not None:
            self.async_worker.drain()

    # -- backends ---------------------------------------------------------------------------------
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
        instance = backend_class(name)(self)
        self._backends[name] = instance
        return instance

    def close(self) -> None:
        """Free every backend and communicator this context holds (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.async_worker is not None:  # queued calls finish before their backends are freed
            self.async_worker.close()
            self.async_worker = None
        for instance in reversed(list(self._backends.values())):
            try:
                instance.close()
            except Exception as exc:  # report, keep closing the rest
                sys.stderr.write(f"mpigpu: closing backend {instance.name} failed: {exc}\n")
        self._backends.clear()
        self.layout.close()


_TEST_VARIABLES = ("MPIGPU_REQUIRE_GPU",)  # read by the test suite, not by mpigpu


def _local_settings() -> tuple[Settings | None, ConfigError | None]:
    try:
        return Settings.from_env(), None
    except ConfigError as exc:
        return None, exc


def _agreed_settings(comm: Any, settings: Settings | None, error: ConfigError | None) -> Settings:
    """Collective: a bad MPIGPU_* value on any rank fails start-up on every rank with that rank's
    message, instead of leaving the others waiting in the next collective."""
    agree(comm, error, "mpigpu start-up")
    assert settings is not None
    if settings.abort_on_exception:
        install_default_handler()
    unknown = sorted(
        k for k in os.environ if k.startswith("MPIGPU_") and k not in ENV_VARS and k not in _TEST_VARIABLES
    )
    if unknown and comm.Get_rank() == 0:  # a misspelt MPIGPU_TIMEOUT would otherwise leave timeouts off, silently
        sys.stderr.write(f"mpigpu: ignoring unknown variable(s) {', '.join(unknown)}; known: {', '.join(ENV_VARS)}\n")
    return settings


def finalize() -> None:
    """Free all pinned memory, device buffers, NCCL communicators and IPC handles mpigpu holds.

    Called automatically at exit; call it earlier to release resources before MPI_Finalize."""
    for ctx in list(Context._by_handle.values()):
        ctx.close()
    Context._by_handle.clear()
