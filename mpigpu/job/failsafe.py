"""No hangs: one rank's failure ends the whole job, and MPIGPU_TIMEOUT bounds every collective.

Both end the job with ``MPI_Abort``, which every MPI launcher turns into the end of all ranks, with
the failing rank's message on stderr. This is the behaviour of ``python -m mpi4py``, applied to
mpigpu's commands, to user scripts run through ``python -m mpigpu.run``, and (main thread only) to
any program once mpigpu has started on a communicator (see ``install_abort_handler``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any, NoReturn

from mpigpu.core._mpi import launcher_rank

__all__ = [
    "Watchdog",
    "abort_before_start",
    "abort_for_exception",
    "abort_job",
    "abort_on_exception",
    "exit_code_of",
    "install_abort_handler",
    "install_default_handler",
    "report_background_failure",
]

TIMEOUT_EXIT_CODE = 124  # what GNU timeout returns, so scripts can tell a timeout from a failure
_FORCE_EXIT_AFTER_S = 10.0  # if MPI_Abort itself does not end the process by then, exit anyway
_GRACE_S = 2.0  # abort_before_start: time for rank 0 to end the job before another rank reports
_FORWARD_S = 0.2  # after printing, before MPI_Abort: the launcher forwards the message (seen lost under load)
_FINALIZE_WAIT_S = 10.0  # _end_together: the other ranks' MPI_Finalize, before aborting instead

_abort_lock = threading.Lock()
_previous_hook: Any = None  # a non-mpigpu sys.excepthook found at installation, called first
_brief = False  # mpigpu's commands: an MpigpuError prints its message only


def _rank() -> int:
    if "mpi4py.MPI" in sys.modules:
        try:
            return sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank()
        except Exception:
            pass
    return launcher_rank()


def _prefix() -> str:
    """``[mpigpu rank 3]`` (``[mpigpu]`` where the rank is not known yet)."""
    rank = _rank()
    return f"[mpigpu rank {rank}]" if rank >= 0 else "[mpigpu]"


def abort_job(message: str, code: int = 1) -> NoReturn:
    """Print ``message`` prefixed with the rank, then end every rank of the job with exit ``code``.

    Safe to call from any thread, also while another thread is blocked in MPI. A second caller (say,
    the watchdog while the main thread is already aborting) waits for the first to finish."""
    if not _abort_lock.acquire(blocking=False):
        while True:  # another thread is ending the process
            time.sleep(1)
    code = code if 0 < code < 256 else 1  # launchers report the exit status modulo 256; 0 is success
    sys.stderr.write(f"{_prefix()} {message}\n")
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):
            stream.flush()
    time.sleep(_FORWARD_S)
    fallback = threading.Timer(_FORCE_EXIT_AFTER_S, os._exit, (code,))
    fallback.daemon = True
    fallback.start()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        with contextlib.suppress(Exception):
            if mpi.Is_initialized() and not mpi.Is_finalized():
                mpi.COMM_WORLD.Abort(code)
    os._exit(code)  # MPI not started (or already finalised): the launcher sees the exit status


def abort_before_start(code: int, message: str) -> NoReturn:
    """End the job from a rank that fails before it has started MPI (an invalid option).

    Exiting alone would leave ranks that did start waiting in MPI_Init or their first collective
    under MPICH's hydra and Slurm's srun (Open MPI's mpirun ends the job), so this starts MPI only
    to abort it. The caller prints ``message`` on rank 0; other ranks print it only if the job is
    still running after a grace period, that is, when rank 0 did not fail the same way (an MPMD
    launch with different options per rank), so a common mistake is reported once, not per rank."""
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        from mpigpu.core._mpi import MPI

        world = MPI().COMM_WORLD
        if world.Get_rank() > 0:
            time.sleep(_GRACE_S)
            sys.stderr.write(f"[mpigpu rank {world.Get_rank()}] {message}\n")
            sys.stderr.flush()
        time.sleep(_FORWARD_S)
        world.Abort(code)
    os._exit(code)


def exit_code_of(exc: BaseException) -> int:
    """The exit status an exception stands for: SystemExit's code, 130 for Ctrl-C, else 1."""
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def _format(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> str:
    from mpigpu.core.errors import MpigpuError

    if _brief and isinstance(value, MpigpuError):  # a user-facing error: its message says it all
        return f"error: {kind.__name__}: {value}"
    return "".join(traceback.format_exception(kind, value, tb)).rstrip()


def _raised_everywhere(exc: BaseException) -> bool:
    """Every rank of the job raised for the same call (mpigpu.job.check.mark_raised_everywhere)."""
    return getattr(exc, "mpigpu_everywhere", False) is True


def _end_together(exc: BaseException, tb: TracebackType | None, code: int) -> NoReturn:
    """Every rank is ending with this call's error: print it once, a line from each other rank, and
    end with MPI_Finalize, not MPI_Abort (whose banner, one per rank, would bury the message).

    The rank whose own arguments failed prints its error; a rank that only learnt of it prints one
    line naming it; where all ranks hold the same MismatchError, rank 0 prints it. If a rank does not
    end after all (it caught the error), MPI_Finalize waits for it: the job is aborted after
    _FINALIZE_WAIT_S."""
    from mpigpu.core.errors import MismatchError

    rank = _rank()
    message = str(exc)
    if not isinstance(exc, MismatchError):
        sys.stderr.write(f"{_prefix()} {_format(type(exc), exc, tb)}\n")
    elif " did not run: " in message.split("\n", 1)[0]:  # another rank failed: it prints its own error
        sys.stderr.write(f"{_prefix()} {message.split(chr(10), 1)[0]}\n")
    elif rank <= 0:
        sys.stderr.write(f"{_prefix()} {_format(type(exc), exc, tb)}\n")
    else:
        sys.stderr.write(f"{_prefix()} stopped by the same MismatchError (printed by rank 0)\n")
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):
            stream.flush()
    fallback = threading.Timer(
        _FINALIZE_WAIT_S,
        abort_job,
        (f"{type(exc).__name__} raised on every rank, but a rank did not end within {_FINALIZE_WAIT_S:g} s: "
         "aborting the job", code),
    )  # fmt: skip
    fallback.daemon = True
    fallback.start()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        with contextlib.suppress(Exception):
            if mpi.Is_initialized() and not mpi.Is_finalized():
                mpi.COMM_WORLD.Barrier()
                mpi.Finalize()
    os._exit(code)


def abort_for_exception(exc: BaseException, tb: TracebackType | None = None) -> NoReturn:
    """Report ``exc`` (with its traceback, from ``tb`` if given) and end every rank of the job: together
    and reported once where every rank raised for the same call, else with MPI_Abort."""
    code = exit_code_of(exc)
    # the main thread only: MPI_Finalize from another thread could cut off the main thread's own MPI calls
    if _raised_everywhere(exc) and _previous_hook is None and threading.current_thread() is threading.main_thread():
        _end_together(exc, tb if tb is not None else exc.__traceback__, code)
    if isinstance(exc, SystemExit):
        if isinstance(exc.code, str):
            sys.stderr.write(f"{exc.code}\n")
        abort_job(f"exited with status {code} while other ranks may still be running: ending the job", code)
    tb = tb if tb is not None else exc.__traceback__
    if _previous_hook is not None:
        with contextlib.suppress(Exception):
            _previous_hook(type(exc), exc, tb)
        text = f"{type(exc).__name__} (reported above)"
    else:
        text = _format(type(exc), exc, tb)
    abort_job(f"{text}\n{_prefix()} unhandled exception: aborting all ranks", code)


def report_background_failure(exc: BaseException, what: str, *, abort: bool) -> None:
    """An exception on one of mpigpu's own threads that the other ranks would wait for: with
    ``abort`` (MPIGPU_ABORT_ON_EXCEPTION=1, the default) and outside a REPL, print it and end every
    rank of the job; otherwise print it now, so it is never lost (the caller raises it later)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    if abort and not _interactive():
        abort_job(f"{text}\n{_prefix()} {what}: aborting all ranks", exit_code_of(exc))
    sys.stderr.write(f"{_prefix()} {text}\n{_prefix()} {what}; handle.wait() raises it\n")
    with contextlib.suppress(Exception):
        sys.stderr.flush()


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if isinstance(value, SystemExit) and exit_code_of(value) == 0:
        return
    abort_for_exception(value if value is not None else kind(), tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    abort_for_exception(args.exc_value or args.exc_type(), args.exc_traceback)


def _interactive() -> bool:
    """A REPL or notebook: there, an uncaught exception is a prompt's error, not the end of the program."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "IPython" in sys.modules


def install_abort_handler(*, threads: bool = True) -> None:
    """From now on, an uncaught exception on this rank ends every rank of the job with its traceback.

    Without it, a rank that dies of an exception leaves the other ranks waiting in their next
    collective until the job is killed. ``threads=True`` also covers exceptions in other threads.
    A sys.excepthook installed before (a logger, a rich traceback) still runs first. Exit handlers
    (atexit) do not run on the aborting rank. Idempotent. mpigpu calls it with ``threads=False``
    when it first starts on a communicator, unless MPIGPU_ABORT_ON_EXCEPTION=0 or in a REPL/notebook."""
    global _previous_hook
    if sys.excepthook is not _excepthook:
        if sys.excepthook not in (sys.__excepthook__, None):
            _previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    if threads:
        threading.excepthook = _thread_excepthook
    with contextlib.suppress(Exception):  # a crash (SIGSEGV, SIGABRT) prints the Python stacks
        if not faulthandler.is_enabled():
            faulthandler.enable()


def install_default_handler() -> None:
    """What mpigpu does when it starts on a communicator: the main-thread handler, outside REPLs."""
    if not _interactive():
        install_abort_handler(threads=False)


def abort_on_exception() -> None:
    """For mpigpu's commands: any uncaught exception (any thread) aborts every rank; an mpigpu error
    prints its message only, without a traceback."""
    global _brief
    _brief = True
    install_abort_handler(threads=True)


class _Watch:
    """One watched operation (the context manager ``Watchdog.watch`` returns)."""

    __slots__ = ("dog", "key", "name", "previous")

    def __init__(self, dog: Watchdog, name: str) -> None:
        self.dog, self.name = dog, name

    def __enter__(self) -> None:
        self.key = threading.get_ident()
        self.previous = self.dog._active.get(self.key)
        # nested: the innermost name, the outermost start
        start = self.previous[1] if self.previous is not None else time.monotonic()
        self.dog._active[self.key] = (self.name, start)

    def __exit__(self, *exc: object) -> None:
        if self.previous is None:
            self.dog._active.pop(self.key, None)
        else:
            self.dog._active[self.key] = self.previous


_NO_WATCH = contextlib.nullcontext()


class Watchdog:
    """Aborts the job when a watched operation runs longer than ``timeout`` seconds (0: never).

    One daemon thread per watchdog, started on first use; ``watch`` costs a dict write per call
    when a timeout is set and nothing at all when not."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._active: dict[int, tuple[str, float]] = {}  # thread id -> (operation, start)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def _expired(self, name: str, thread_id: int, waited: float) -> NoReturn:
        frame = sys._current_frames().get(thread_id)
        stack = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(not available)"
        abort_job(
            f"CollectiveTimeout: {name} did not complete within MPIGPU_TIMEOUT={self.timeout:g} s "
            f"(waited {waited:.1f} s): another rank has failed, is stuck, or did not call it. "
            f"Aborting the job. Where this rank waited:\n{stack}",
            TIMEOUT_EXIT_CODE,
        )

    def _run(self) -> None:
        period = min(1.0, max(0.05, self.timeout / 10))
        while True:
            time.sleep(period)
            now = time.monotonic()
            for thread_id, (name, start) in self._active.copy().items():
                if now - start > self.timeout:
                    self._expired(name, thread_id, now - start)

    def watch(self, name: str) -> Any:
        """A context manager: abort the job if its body has not finished after ``timeout`` seconds."""
        if self.timeout <= 0:
            return _NO_WATCH
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="mpigpu-watchdog", daemon=True)
                    self._thread.start()
        return _Watch(self, name)
