"""mpigpu's pytest plugin (entry point ``pytest11``): a stall report or a timeout's abort message reaches
the terminal even while pytest captures output (mpigpu.core.console). Imports nothing else of mpigpu."""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    from mpigpu.core.console import follow_pytest_capture

    follow_pytest_capture(config)
