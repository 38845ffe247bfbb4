"""``mpiexec -n N python -m mpigpu.run script.py [args]``: run a program so that one rank's failure
ends the whole job, with that rank's message, instead of leaving the other ranks waiting.

Like ``python -m mpi4py``: the script (or ``-m module``, or ``-c code``) runs as ``__main__`` with
sys.argv as Python would set it. An uncaught exception in any thread prints its traceback and calls
MPI_Abort; ``sys.exit(n)`` with n != 0 on one rank ends the job with status n. A normal end (or
``sys.exit(0)``) exits normally. ``--timeout S`` sets MPIGPU_TIMEOUT for the run. SIGINT (Ctrl-C) on
any rank ends the job with status 130, also on a rank blocked in a collective.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import textwrap
import threading
import time
import traceback
from types import FrameType, TracebackType

from mpigpu._version import __version__
from mpigpu.cli import launcher_rank, prog

__all__ = ["main"]

USAGE = f"""\
usage: {prog("mpigpu.run")} [--timeout SECONDS] <script.py> [arg ...]
   or: {prog("mpigpu.run")} [--timeout SECONDS] -m <module> [arg ...]
   or: {prog("mpigpu.run")} [--timeout SECONDS] -c <code> [arg ...]"""

HELP = (
    USAGE
    + "\n\n"
    + textwrap.dedent("""\
    Run a Python program under your MPI launcher so that a failure on one rank ends every rank
    within seconds, with that rank's traceback, instead of a hang:
      mpiexec -n 4 python -m mpigpu.run train.py --epochs 3

    An uncaught exception (in any thread) prints its traceback prefixed with the rank and aborts
    the job (MPI_Abort); the job's exit status is 1. sys.exit(N) with N != 0 on any rank ends the
    job with status N. SIGINT (Ctrl-C) on any rank raises KeyboardInterrupt there, which ends the
    job with status 130; a rank that cannot take it within a second (blocked in a collective or
    other C code) ends the job at once. The program's normal end is a normal exit.

    options:
      -h, --help           show this help and exit
      --version            show mpigpu's version and exit
      --timeout SECONDS    abort the job when an mpigpu collective has not completed within
                           SECONDS (sets MPIGPU_TIMEOUT; default: the variable's value, else 600; 0 = off)
      -m MODULE            run a module as __main__, like python -m
      -c CODE              run the code string as __main__, like python -c

    exit status: the program's; 1 for an uncaught exception; 130 for SIGINT; 2 for invalid options
    here.""")
)


class _Usage(Exception):
    """Invalid command line for mpigpu.run itself."""


def _parse(argv: list[str]) -> tuple[str, str, list[str], str | None]:
    """(kind, target, program argv, timeout); kind is "path", "module", "code", "help" or "version"."""
    timeout = None
    args = list(argv)
    while args:
        arg = args[0]
        if arg in ("-h", "--help"):
            return "help", "", [], None
        if arg == "--version":
            return "version", "", [], None
        if arg == "--timeout" or arg.startswith("--timeout="):
            if "=" in arg:
                value = arg.partition("=")[2]
                del args[0]
            elif len(args) >= 2:
                value = args[1]
                del args[:2]
            else:
                raise _Usage("--timeout needs a value in seconds")
            timeout = _seconds(value)
            continue
        if arg in ("-m", "-c"):
            if len(args) < 2:
                raise _Usage(f"{arg} needs an argument")
            kind = "module" if arg == "-m" else "code"
            return kind, args[1], [args[1] if kind == "module" else "-c", *args[2:]], timeout
        if arg == "-":
            raise _Usage("reading the program from standard input is not supported: pass a file")
        if arg.startswith("-"):
            raise _Usage(f"unknown option {arg!r} (options go before the script; the script's own after it)")
        return "path", arg, args, timeout
    raise _Usage("no program given: pass a script, -m module or -c code")


def _seconds(text: str) -> str:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise _Usage(f"--timeout {text!r}: give a number of seconds >= 0 (0 = off)")
    return text


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the runner's own frames (this module, runpy) from the front of a traceback."""
    runner = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or "")}
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if os.path.abspath(filename) not in runner and not filename.startswith("<frozen runpy"):
            break
        tb = tb.tb_next
    return tb


def _execute(kind: str, target: str, program_argv: list[str]) -> None:
    """Run the program as __main__, with sys.argv and sys.path[0] as ``python`` would set them."""
    sys.argv[:] = program_argv
    if kind == "module":  # sys.path[0] is already the current directory, as for python -m
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "code":
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


_SIGINT_GRACE_S = 1.0  # time for the main thread to raise KeyboardInterrupt before the job is ended for it


def _end_job_on_sigint() -> None:
    """Make SIGINT end the job even while the main thread is blocked in MPI.

    Python runs signal handlers on the main thread between bytecodes, so a rank blocked in a
    collective would hold a pending KeyboardInterrupt until the collective completes: forever, if
    the other ranks wait for this one. The handler below raises KeyboardInterrupt as Python's
    does (the runner turns it into the end of the job); a watcher thread, woken through the
    signal wakeup descriptor, which is written from C as the signal arrives, ends the job itself if
    the handler has not run within _SIGINT_GRACE_S. A handler the program installs replaces this
    one, and then the program decides."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # SIGINT ignored by the launcher (a background job), or handled by someone else already
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    handled = [0]

    def handler(signum: int, frame: FrameType | None) -> None:
        handled[0] += 1
        raise KeyboardInterrupt

    def watch() -> None:
        received = 0
        while True:
            data = os.read(read_end, 64)
            received += data.count(signal.SIGINT)
            if signal.SIGINT not in data or signal.getsignal(signal.SIGINT) is not handler:
                continue
            deadline = time.monotonic() + _SIGINT_GRACE_S
            while handled[0] < received and time.monotonic() < deadline:
                time.sleep(0.02)
            if handled[0] < received:
                _abort_for_blocked_sigint()

    signal.signal(signal.SIGINT, handler)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=watch, name="mpigpu-sigint", daemon=True).start()


def _abort_for_blocked_sigint() -> None:
    from mpigpu.job import failsafe

    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    stack = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(not available)"
    failsafe.abort_job(
        f"KeyboardInterrupt (SIGINT) while the main thread was blocked outside Python (in a collective or other "
        f"C code) for {_SIGINT_GRACE_S:g} s: ending the job. Where it waited:\n{stack}",
        failsafe.exit_code_of(KeyboardInterrupt()),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the program; return its exit status (abort the job instead if it fails on this rank)."""
    from mpigpu.job import failsafe

    try:
        kind, target, program_argv, timeout = _parse(sys.argv[1:] if argv is None else argv)
        if kind == "path" and not os.path.isfile(target):
            raise _Usage(f"can't open file {target!r}: no such file")
    except _Usage as exc:
        if launcher_rank() <= 0:
            sys.stderr.write(f"{prog('mpigpu.run')}: error: {exc}\n{USAGE}\n")
        if launcher_rank() >= 0:  # ranks launched with valid arguments (MPMD) must not wait for this one
            failsafe.abort_before_start(2, f"{prog('mpigpu.run')}: error: {exc}")
        return 2
    if kind == "help":
        print(HELP)
        return 0
    if kind == "version":
        print(f"mpigpu {__version__}")
        return 0
    if timeout is not None:
        os.environ["MPIGPU_TIMEOUT"] = timeout
    failsafe.install_abort_handler()
    _end_job_on_sigint()
    try:
        _execute(kind, target, program_argv)
    except SystemExit as exc:
        if failsafe.exit_code_of(exc) != 0:
            failsafe.abort_for_exception(exc)
    except BaseException as exc:
        failsafe.abort_for_exception(exc, _user_frames(exc.__traceback__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
