"""Where mpigpu's job-ending reports go: stderr, and also the terminal a test runner's capture hides.

pytest captures file descriptor 2 during each test. A stall report or a timeout's abort message
written there is lost: the job ends inside the test, before pytest prints what it captured (seen on
2 x H100: the GPU suite stalled and ended by the timeout's abort with nothing printed that named the
call). ``follow_pytest_capture`` gives mpigpu a duplicate of the descriptor pytest saved, and
``report`` writes to it as well as to stderr. mpigpu's pytest plugin (``pytest -p mpigpu.pytest_plugin``)
does this for a run; mpigpu's own tests/conftest.py does it too."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

__all__ = ["also_to", "follow_pytest_capture", "report"]

_extra: list[int] = []  # descriptors that also get every report (duplicates, owned here)


def report(text: str) -> None:
    """Write ``text`` (a whole message, ending in a newline) to stderr and to the extra descriptors.
    Safe from any thread: the extra copies are single ``os.write`` calls, not buffered."""
    with contextlib.suppress(Exception):
        sys.stderr.write(text)
        sys.stderr.flush()
    for fd in _extra:
        with contextlib.suppress(OSError):
            os.write(fd, text.encode("utf-8", "replace"))


def also_to(fd: int) -> None:
    """Send every later report to ``fd`` too (duplicated: the caller may close its own)."""
    try:
        os.fstat(fd)
        _extra.append(os.dup(fd))
    except OSError:
        pass


def follow_pytest_capture(config: Any) -> None:
    """If pytest captures file descriptor 2, report to the terminal it saved as well (once per process).
    Relies on pytest's capture manager keeping the saved descriptor as ``targetfd_save``; where a pytest
    version does not, nothing changes."""
    if _extra:
        return
    manager = config.pluginmanager.getplugin("capturemanager")
    err = getattr(getattr(manager, "_global_capturing", None), "err", None)
    saved = getattr(err, "targetfd_save", None)
    if isinstance(saved, int):
        also_to(saved)
