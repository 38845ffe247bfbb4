"""mpigpu's pytest plugin: a stall report or a timeout's abort message reaches the terminal even while
pytest captures output (mpigpu.core.console). Opt in with ``pytest -p mpigpu.pytest_plugin`` or
``pytest_plugins = ["mpigpu.pytest_plugin"]`` in a conftest.py. Not registered as an entry point on
purpose: that would import mpigpu, and install its abort hooks, in every pytest run of the environment."""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    from mpigpu.core.console import follow_pytest_capture

    follow_pytest_capture(config)
