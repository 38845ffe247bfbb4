"""The boards' compiled exchange (mpigpu/job/native_board.py), in one process: built once into the private
cache and then loaded from it without starting any process (a fork in an MPI process is what some MPI
stacks warn about); MPIGPU_BOARD_HANDLER=python and a missing compiler keep the Python path, with the
reason; a fold of a dtype the C code does not reduce is refused before it runs."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from mpigpu.core.ops import Op
from mpigpu.job import native_board


def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper forgotten by this process for the test (and again after it: the next user reloads it)."""
    monkeypatch.setattr(native_board, "_state", [])


@pytest.mark.skipif(native_board.why_not() is not None, reason=f"the compiled board: {native_board.why_not()}")
def test_a_cached_helper_loads_without_starting_a_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPIGPU_CACHE_DIR", str(tmp_path))
    _fresh(monkeypatch)
    assert native_board.why_not() is None, "built into the new cache"
    assert list((tmp_path / "board").glob("board-*.so")), "the entry is stored"
    _fresh(monkeypatch)

    def no_process(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "run", no_process)
    assert native_board.why_not() is None, "loaded from the cache, no compiler run"


def test_without_a_compiler_the_python_path_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh(monkeypatch)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    why = native_board.why_not()
    assert why is not None and "CC='/nonexistent/cc' is not a command here" in why and "Python path" in why
    assert native_board.compiled(lambda: []) is None


def test_the_setting_keeps_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPIGPU_BOARD_HANDLER", "python")
    assert native_board.why_not() == "MPIGPU_BOARD_HANDLER=python"
    assert native_board.compiled(lambda: []) is None


def test_a_fold_of_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="does not reduce dtype code 1"):
        native_board.Native.fold(1, Op.SUM, 4, 0)  # float16: the board never takes it (is_plain)


@pytest.mark.parametrize(("code", "op"), [(3, Op.MIN), (4, Op.MAX), (9, Op.AVG), (5, Op.AVG)])
def test_a_fold_the_board_never_takes_is_refused(code: int, op: Op) -> None:
    """Float min/max (ordered by keys) and integer avg (exact parts) never reach the board: the C fold would
    sum or take the max there, so asking for one is an error, not a wrong result."""
    with pytest.raises(ValueError, match=f"does not reduce dtype code {code}"):
        native_board.Native.fold(code, op, 4, 0)
