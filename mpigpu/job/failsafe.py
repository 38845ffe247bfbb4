"""No hangs: one rank's failure ends the whole job, and MPIGPU_TIMEOUT bounds every collective.

Both end the job with ``MPI_Abort``, which every MPI launcher turns into the end of all ranks, with
the failing rank's message on stderr. This is the behaviour of ``python -m mpi4py``, applied to
mpigpu's commands, to user scripts run through ``python -m mpigpu.run``, and to any program that
imports mpigpu, once MPI runs with more than one rank (see ``hook_at_import``).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

from mpigpu.core._mpi import launcher_rank
from mpigpu.core.console import report
from mpigpu.job import leave
from mpigpu.job.mpich_shm import remove_own_segments

__all__ = [
    "Watchdog",
    "abort_before_start",
    "abort_for_exception",
    "abort_job",
    "abort_on_exception",
    "exit_code_of",
    "hook_at_import",
    "install_abort_handler",
    "install_default_handler",
    "report_background_failure",
]

TIMEOUT_EXIT_CODE = 124  # what GNU timeout returns, so scripts can tell a timeout from a failure
_FORCE_EXIT_AFTER_S = 10.0  # if MPI_Abort itself does not end the process by then, exit anyway
_GRACE_S = 2.0  # abort_before_start: time for rank 0 to end the job before another rank reports
_FORWARD_S = 0.2  # after printing, before MPI_Abort: the launcher forwards the message (seen lost under load)
_FINALIZE_WAIT_S = 10.0  # _end_together: the other ranks' MPI_Finalize, before aborting instead

_get_ident = threading.get_ident  # bound once: the watch runs on every call
_abort_lock = threading.Lock()
_previous_hook: Any = None  # a non-mpigpu sys.excepthook found at installation, called first
_previous_thread_hook: Any = None  # likewise for threading.excepthook
_builtin_exit = sys.exit  # replaced by _exit in _hook
_always = False  # install_abort_handler was called: abort whether or not MPI runs
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
    report(f"{_prefix()} {message}\n")  # also to the terminal a test runner's capture hides
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
                remove_own_segments()  # MPI_Abort leaves MPICH no chance to
                mpi.COMM_WORLD.Abort(code)
    os._exit(code)  # MPI not started (or already finalised): the launcher sees the exit status


def _finish_abort_first() -> None:
    """At the interpreter's exit (atexit): an abort another thread has begun (the watchdog's
    ``MPIGPU_TIMEOUT``, a thread's uncaught exception) ends the job with its status; without this the
    main thread's normal end could win the race and the job exit 0 after "Aborting the job" was printed
    (issue 39: ``MPIGPU_TIMEOUT=0.001``). Where no abort is under way, this takes the abort lock, so
    none begins: the program has ended normally, and a late abort would only cut off its exit."""
    if _abort_lock.acquire(blocking=False):
        return
    while True:  # the aborting thread ends the process (MPI_Abort, else os._exit after _FORCE_EXIT_AFTER_S)
        time.sleep(1)


atexit.register(_finish_abort_first)  # registers a function only: starts and imports nothing


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
        remove_own_segments()
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


_PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")  # .../mpigpu/


def user_traceback(value: BaseException, tb: TracebackType | None) -> tuple[TracebackType | None, int]:
    """An mpigpu error's traceback as NumPy's and torch's read: ending at the caller's own line, the
    last frame outside mpigpu, and how many of mpigpu's frames below it were left out (none with
    MPIGPU_DEBUG=1, for other exceptions, or where no frame is the caller's). The exception's own
    traceback and its causes are not changed."""
    from mpigpu.core.config import settings
    from mpigpu.core.errors import MpigpuError

    frames = []
    entry = tb
    while entry is not None:
        frames.append(entry)
        entry = entry.tb_next
    outside = [i for i, e in enumerate(frames) if not e.tb_frame.f_code.co_filename.startswith(_PACKAGE)]
    if not isinstance(value, MpigpuError) or not outside or outside[-1] == len(frames) - 1:
        return tb, 0
    try:
        if settings().debug:
            return tb, 0
    except Exception:  # a bad setting elsewhere: the traceback as it is
        return tb, 0
    last = outside[-1]
    kept: TracebackType | None = None
    for entry in reversed(frames[: last + 1]):
        kept = TracebackType(kept, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return kept, len(frames) - 1 - last


def _format(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> str:
    from mpigpu.core.errors import MpigpuError

    if _brief and isinstance(value, MpigpuError):  # a user-facing error: its message says it all
        return f"error: {kind.__name__}: {value}"
    tb, hidden = user_traceback(value, tb)
    text = "".join(traceback.format_exception(kind, value, tb)).rstrip()
    return text + (f"\n({hidden} frames inside mpigpu not shown: MPIGPU_DEBUG=1 shows them)" if hidden else "")


def _raised_everywhere(exc: BaseException) -> bool:
    """Every rank of the job raised for the same call (mpigpu.job.check.mark_raised_everywhere)."""
    return getattr(exc, "mpigpu_everywhere", False) is True


def _end_together(exc: BaseException, tb: TracebackType | None, code: int) -> NoReturn:
    """Every rank is ending with this call's error: print it once, a line from each other rank, and
    end with MPI_Finalize, not MPI_Abort (whose banner, one per rank, would bury the message).

    The rank whose own arguments failed prints its error; a rank that only learnt of it prints one
    line naming it; where all ranks hold the same error (a MismatchError, or one marked ``same_text``:
    a bad setting at start-up), rank 0 prints it. Rank 0 exits first, once the others are past
    MPI_Finalize (mpigpu.job.leave: the launcher then kills no rank still finalising). If a rank does
    not end after all (it caught the error), the others wait for it: the job is aborted after
    _FINALIZE_WAIT_S."""
    from mpigpu.core.errors import MismatchError

    rank = _rank()
    message = str(exc)
    same = isinstance(exc, MismatchError) or getattr(exc, "mpigpu_same_text", False) is True
    if not same:
        sys.stderr.write(f"{_prefix()} {_format(type(exc), exc, tb)}\n")
    elif isinstance(exc, MismatchError) and " did not run: " in message.split("\n", 1)[0]:
        sys.stderr.write(f"{_prefix()} {message.split(chr(10), 1)[0]}\n")  # the failing rank prints its own error
    elif rank <= 0:
        sys.stderr.write(f"{_prefix()} {_format(type(exc), exc, tb)}\n")
    else:
        sys.stderr.write(f"{_prefix()} stopped by the same {type(exc).__name__} (printed by rank 0)\n")
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
    peers = leave.Peers(rank, [], False)
    if mpi is not None:
        with contextlib.suppress(Exception):
            if mpi.Is_initialized() and not mpi.Is_finalized():
                peers = leave.gather_peers(mpi.COMM_WORLD)
                # Past that exchange every rank has mapped the job's MPICH file. MPI_Finalize unlinks it
                # on the rank that created it, but a launcher that kills the ranks still finalising
                # would leave it: each rank removes it first (issue 39: 1 run in 3 left it).
                remove_own_segments()
                mpi.Finalize()
    leave.after_finalize(peers)  # rank 0 exits first, once no rank is still finalising
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


def _mpi_job_running() -> bool:
    """MPI is up in this process with more than one rank: found without importing or starting it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    try:
        return bool(mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1)
    except Exception:
        return False


def _aborts() -> bool:
    """Whether an uncaught exception now ends the job: always after ``install_abort_handler``;
    else (the hook ``import mpigpu`` installs) once MPI runs with more than one rank, outside REPLs."""
    return _always or (_mpi_job_running() and not _interactive())


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if isinstance(value, SystemExit) and exit_code_of(value) == 0:
        return
    if not _aborts():
        shown, hidden = user_traceback(value, tb) if value is not None else (tb, 0)
        if hidden:  # the hook may print value.__traceback__ rather than its argument (CPython's does)
            value.__traceback__ = shown
        try:
            (_previous_hook or sys.__excepthook__)(kind, value, shown)
        finally:
            if hidden:
                value.__traceback__ = tb
        if hidden:
            sys.stderr.write(f"({hidden} frames inside mpigpu not shown: MPIGPU_DEBUG=1 shows them)\n")
        return
    abort_for_exception(value if value is not None else kind(), tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    if not _aborts():
        (_previous_thread_hook or threading.__excepthook__)(args)
        return
    abort_for_exception(args.exc_value or args.exc_type(), args.exc_traceback)


def _interactive() -> bool:
    """A REPL or notebook: there, an uncaught exception is a prompt's error, not the end of the program."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "IPython" in sys.modules


class _JobExit(SystemExit):
    """What ``sys.exit(n)`` raises on the main thread while mpigpu's hooks are installed: a SystemExit
    that, when nothing catches it, ends the whole job with status n (n != 0) once MPI runs with more
    than one rank. Python gives no hook for SystemExit (sys.excepthook never sees it), and a rank that
    simply exits waits in MPI_Finalize for ranks that wait in a collective for it: a hang until
    MPIGPU_TIMEOUT, with its status lost. Python frees the exception that ends the program before the
    exit handlers run, with no Python frame on the stack; one the program caught is freed by its code."""

    def __del__(self) -> None:
        try:
            sys._getframe(1)
        except ValueError:  # no Python frame: Python itself is ending the program with this exit
            code = exit_code_of(self)
            if code != 0 and not _brief and _mpi_job_running() and not _interactive():
                abort_job(f"exited with status {code} while other ranks may still be running: ending the job", code)
        except Exception:  # freed while the interpreter shuts down (the program kept it): too late to act
            return


def _exit(status: object = None) -> NoReturn:
    """``sys.exit`` while mpigpu's hooks are installed (the same, but for ``_JobExit`` on the main thread)."""
    if threading.current_thread() is threading.main_thread():
        raise _JobExit(status)
    raise SystemExit(status)


def _hook() -> None:
    """Make mpigpu's hooks sys.excepthook, threading.excepthook and sys.exit, keeping hooks installed
    before (a logger, a rich traceback) to run first (idempotent). A sys.exit replaced by someone else
    stays."""
    global _previous_hook, _previous_thread_hook
    if sys.exit is _builtin_exit:
        sys.exit = _exit
    if sys.excepthook is not _excepthook:
        if sys.excepthook not in (sys.__excepthook__, None):
            _previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    if threading.excepthook is not _thread_excepthook:
        if threading.excepthook is not threading.__excepthook__:
            _previous_thread_hook = threading.excepthook
        threading.excepthook = _thread_excepthook


def _opted_out() -> bool:
    """MPIGPU_ABORT_ON_EXCEPTION=0 (or false, no, off); an invalid value is reported at start-up."""
    return os.environ.get("MPIGPU_ABORT_ON_EXCEPTION", "").strip().lower() in ("0", "false", "no", "off")


def hook_at_import() -> None:
    """What ``import mpigpu`` does: install the hooks, which end the job on an uncaught exception (any
    thread) or an uncaught ``sys.exit(n)``, n != 0, only while MPI runs with more than one rank, outside
    REPLs; otherwise they pass the exception on. Starts nothing and imports nothing.
    MPIGPU_ABORT_ON_EXCEPTION=0 turns it off."""
    if not _opted_out():
        _hook()


def install_abort_handler() -> None:
    """From now on, an uncaught exception on this rank ends every rank of the job with its traceback,
    also before MPI has started.

    ``import mpigpu`` already does so once MPI runs with more than one rank (``hook_at_import``);
    call this to cover the rest (MPI started by mpigpu later, a REPL). A sys.excepthook installed
    before still runs first; exceptions in any thread are covered. Exit handlers (atexit) do not
    run on the aborting rank. Idempotent."""
    global _always
    _always = True
    _hook()
    _enable_faulthandler()


def install_default_handler() -> None:
    """What mpigpu does when it starts on a communicator (unless MPIGPU_ABORT_ON_EXCEPTION=0): put the
    hooks back if the program replaced them after ``import mpigpu``, and print the Python stacks on a
    crash (SIGSEGV, SIGABRT) outside REPLs."""
    _hook()
    if not _interactive():
        _enable_faulthandler()


def _enable_faulthandler() -> None:
    with contextlib.suppress(Exception):
        if not faulthandler.is_enabled():
            faulthandler.enable()


def abort_on_exception() -> None:
    """For mpigpu's commands: any uncaught exception (any thread) aborts every rank; an mpigpu error
    prints its message only, without a traceback."""
    global _brief
    _brief = True
    install_abort_handler()


class _Watch:
    """One watched operation (the context manager ``Watchdog.watch`` returns): registered when made,
    since ``with`` follows at once."""

    __slots__ = ("active", "key", "previous")

    def __init__(self, active: dict[int, tuple[Any, ...]], what: tuple[Any, ...]) -> None:
        key = self.key = _get_ident()
        self.previous = active.get(key)
        active[key] = what  # a new tuple per watch: the watchdog times it by identity
        self.active = active

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        if self.previous is None:
            self.active.pop(self.key, None)
        else:
            self.active[self.key] = self.previous


_NO_WATCH = contextlib.nullcontext()


def _label(what: tuple[Any, ...]) -> str:
    """The name of a watched operation: ``(name,)``, or ``(call, phase)`` for a call that names
    itself only when reported (``call.watch_label(phase)``), so the hot path formats nothing."""
    return what[0] if len(what) == 1 else what[0].watch_label(what[1])


class Watchdog:
    """Watches mpigpu's collectives on one communicator: after ``stall`` seconds in one, prints a
    line saying where this rank waits and who has not arrived (``where()``); after ``timeout``
    seconds, aborts the job (0 turns either off).

    Cheap on every call: a watched thread only puts a new tuple in ``active`` (thread id -> what it
    does) and takes it out after; the watchdog's thread, started with the first ``watch``, samples
    ``active`` every ``period`` seconds and times each tuple from when it first saw it (so a report
    comes up to one period late). Callers test ``on`` first: nothing at all is done when both are 0.

    ``gone`` (optional) names the ranks whose processes have ended ("" while none has): once a wait has
    lasted a period, it is asked each period, and a rank gone on two samples in a row of the same wait
    ends the job (exit status 1): the call can never complete, and waiting for the timeout would only
    hide why (issue 39). The second sample spares a call that was about to end anyway."""

    def __init__(
        self,
        timeout: float,
        stall: float = 0.0,
        where: Callable[[], str] | None = None,
        gone: Callable[[], str] | None = None,
    ) -> None:
        self.stall = stall
        self.set_timeout(timeout)
        self._where = where
        self._gone = gone
        self._gone_in: dict[int, tuple[Any, ...]] = {}  # thread id -> the wait in which a rank was first seen gone
        self.active: dict[int, tuple[Any, ...]] = {}  # thread id -> (name,) or (call, phase)
        self._sources: list[Callable[[], dict[int, tuple[Any, ...]]]] = []  # waits Python cannot see (add_source)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopped = threading.Event()  # stop(): the communicator is freed, its thread ends

    def set_timeout(self, timeout: float) -> None:
        """Abort after ``timeout`` seconds in one call from now on (a torch process group's timeout)."""
        self.timeout = timeout
        self.on = timeout > 0 or self.stall > 0
        self.period = min([1.0] + [max(0.05, t / 10) for t in (timeout, self.stall) if t > 0])

    def _expired(self, what: tuple[Any, ...], thread_id: int, waited: float) -> NoReturn:
        frame = sys._current_frames().get(thread_id)
        stack = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(not available)"
        abort_job(
            f"CollectiveTimeout: {_label(what)} did not complete within MPIGPU_TIMEOUT={self.timeout:g} s "
            f"(waited {waited:.1f} s): another rank has failed, is stuck, or did not call it. "
            f"Aborting the job. Where this rank waited:\n{stack}",
            TIMEOUT_EXIT_CODE,
        )

    def _peer_gone(self, thread_id: int, what: tuple[Any, ...], waited: float) -> None:
        """End the job if a rank this one waits for has ended (``gone``) on two samples of this wait; never raises."""
        try:
            who = self._gone() if self._gone is not None else ""
        except Exception:  # the check must never end the watchdog
            return
        if not who:
            self._gone_in.pop(thread_id, None)
        elif self._gone_in.get(thread_id) is not what:
            self._gone_in[thread_id] = what  # the next sample decides: a call about to end has ended by then
        else:
            abort_job(
                f"RankGone: {who} ended while this rank waits in {_label(what)} (for {waited:.1f} s): a rank "
                "left the job without MPI_Finalize (os._exit, a signal, a crash), so the call can never "
                "complete. Aborting the job.",
                1,
            )

    def _stalled(self, what: tuple[Any, ...], waited: float) -> None:
        """One line: the call this rank waits in, and which ranks have not reached it."""
        where = ""
        if self._where is not None:
            try:
                where = f", {self._where()}"
            except Exception as exc:  # the report must never end the watchdog
                where = f", (where the others are is not known: {exc})"
        then = (
            f"MPIGPU_TIMEOUT aborts the job at {self.timeout:g} s" if self.timeout > 0 else "MPIGPU_TIMEOUT=0: no abort"
        )
        report(
            f"{_prefix()} stalled: waiting {waited:.0f} s in {_label(what)}{where}. Every rank must make the same "
            f"mpigpu calls in the same order; {then} (MPIGPU_STALL sets this report's delay).\n"
        )

    def _run(self) -> None:
        seen: dict[int, tuple[tuple[Any, ...], float, bool]] = {}  # thread id -> (what, first seen, reported)
        while not self._stopped.wait(self.period):
            now = time.monotonic()
            active = self.active.copy()
            for source in self._sources:
                try:
                    active.update(source())
                except Exception:  # a source must never end the watchdog
                    continue
            for thread_id in [t for t in seen if t not in active]:
                del seen[thread_id]
                self._gone_in.pop(thread_id, None)
            for thread_id, what in active.items():
                entry = seen.get(thread_id)
                if entry is None or entry[0] is not what:
                    seen[thread_id] = (what, now, False)
                    continue
                waited = now - entry[1]
                if 0 < self.timeout < waited:
                    self._expired(what, thread_id, waited)
                if self._gone is not None:
                    self._peer_gone(thread_id, what, waited)
                if 0 < self.stall < waited and not entry[2]:
                    seen[thread_id] = (what, entry[1], True)
                    self._stalled(what, waited)

    def add_source(self, source: Callable[[], dict[int, tuple[Any, ...]]]) -> None:
        """Also watch what ``source()`` returns each period: waits outside Python (mpigpu.jax's compiled
        handler), as ``active`` entries keyed by a number no thread id takes (negative), each entry the
        same object for as long as one wait lasts. Starts the watchdog's thread."""
        self._sources.append(source)
        self.start()

    def start(self) -> None:
        """Start the watchdog's thread (idempotent; ``watch`` calls it)."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="mpigpu-watchdog", daemon=True)
                    self._thread.start()

    def stop(self) -> None:
        """End the watchdog's thread within a period (its communicator is freed: nothing is left to watch,
        and the thread would otherwise keep the context alive to the end of the process). Idempotent;
        not started again."""
        self._stopped.set()

    def enter(self, call: Any, phase: str) -> Any:
        """Show that this thread is in ``phase`` of ``call`` (an object with ``watch_label(phase)``, named only
        if reported: the hot path formats nothing); return what was there, for ``leave``. Callers test ``on``
        first; the thread that samples ``active`` was started when the communicator's context was made."""
        active = self.active
        ident = threading.get_ident()
        previous = active.get(ident)
        active[ident] = (call, phase)
        return previous

    def leave(self, previous: Any) -> None:
        """End what ``enter`` showed, putting back what it returned."""
        if previous is None:
            self.active.pop(threading.get_ident(), None)
        else:
            self.active[threading.get_ident()] = previous

    def watch(self, name: str) -> Any:
        """A context manager: report a stall, and abort the job if its body has not finished in time."""
        if not self.on:
            return _NO_WATCH
        if self._thread is None:
            self.start()
        return _Watch(self.active, (name,))
