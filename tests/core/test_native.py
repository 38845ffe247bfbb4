"""mpigpu.core.native: compiled host helpers loaded from memory. Two libraries loaded one after the other
are two libraries (the loader knows a library by its /proc/self/fd path: a freed descriptor number given
to the next one used to hand back the first), and a missing compiler is a BuildFailed naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import missing_compiler

from mpigpu.core.native import BuildFailed, compiler, load_from_memory, run


@pytest.mark.skipif(missing_compiler("c") is not None, reason=f"no C compiler here: {missing_compiler('c')}")
def test_two_libraries_loaded_from_memory_stay_two(tmp_path: Path) -> None:
    loaded = []
    for value in (11, 22):
        source, built = tmp_path / f"lib{value}.c", tmp_path / f"lib{value}.so"
        source.write_text(f"int answer_{value}(void) {{ return {value}; }}\n")
        run([*compiler("c"), "-shared", "-fPIC", str(source), "-o", str(built)])
        loaded.append(load_from_memory(built.read_bytes(), f"mpigpu-test-{value}"))
    assert loaded[0].answer_11() == 11
    assert loaded[1].answer_22() == 22, "the second library is its own, not the first handed back"
    with pytest.raises(AttributeError):
        loaded[1].answer_11  # noqa: B018 - the lookup itself is the test


def test_a_compiler_named_but_missing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(BuildFailed, match="CC='/nonexistent/cc' is not a command here"):
        compiler("c")
