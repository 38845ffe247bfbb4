"""No hangs: one rank's failure ends the whole job, and MPIGPU_TIMEOUT bounds every collective.

Both end the job with ``MPI_Abort``, which every MPI launcher turns into the end of all ranks, with
the failing rank's message on stderr. This is the behaviour of ``python -m mpi4py``, applied to
mpigpu's commands and to user scripts run through ``python -m mpigpu.run``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from types import TracebackType

__all__ = ["Watchdog", "abort_job", "abort_on_exception"]

_ABORT_CODE_TIMEOUT = 124


def _rank() -> int:
    if "mpi4py.MPI" in sys.modules:
        try:
            return sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank()
        except Exception:
            pass
    from mpigpu.cli import launcher_rank

    return launcher_rank()


def abort_job(message: str, code: int = 1) -> None:
    """Print ``message`` prefixed with the rank, then end every rank of the job."""
    sys.stderr.write(f"[mpigpu rank {_rank()}] {message}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized():
                mpi.COMM_WORLD.Abort(code)
        except Exception:
            pass
    os._exit(code)


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    from mpigpu.errors import MpigpuError

    if isinstance(value, MpigpuError):  # a user-facing error: its message says it all
        text = f"error: {kind.__name__}: {value}"
    else:
        text = "".join(traceback.format_exception(kind, value, tb)).rstrip()
    if isinstance(value, SystemExit):
        code = value.code if isinstance(value.code, int) else 1
        if code == 0:
            return
        abort_job(f"exited with code {code}; ending the job", code)
    abort_job(f"{text}\n[mpigpu rank {_rank()}] unhandled exception: aborting all ranks", 1)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    _excepthook(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)


def abort_on_exception() -> None:
    """From now on, an uncaught exception (in any thread) on this rank aborts every rank."""
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook


class Watchdog:
    """Aborts the job when a watched operation runs longer than ``timeout`` seconds.

    One daemon thread per process; ``watch`` is cheap (two attribute writes) when nothing expires.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._active: dict[int, tuple[str, float]] = {}
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, max(0.05, self.timeout / 10)))
            now = time.monotonic()
            with self._lock:
                expired = [(name, start) for name, start in self._active.values() if now - start > self.timeout]
            if expired:
                name, start = expired[0]
                abort_job(
                    f"{name} did not complete within MPIGPU_TIMEOUT={self.timeout:g} s "
                    f"(waited {now - start:.1f} s): another rank may have failed or not called it. "
                    "Aborting the job.",
                    _ABORT_CODE_TIMEOUT,
                )

    @contextlib.contextmanager
    def watch(self, name: str) -> Iterator[None]:
        """Abort the job if the body has not finished after ``timeout`` seconds."""
        if self.timeout <= 0:
            yield
            return
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="mpigpu-watchdog", daemon=True)
                    self._thread.start()
        key = threading.get_ident()
        self._active[key] = (name, time.monotonic())
        try:
            yield
        finally:
            self._active.pop(key, None)
