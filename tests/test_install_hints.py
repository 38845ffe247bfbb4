"""Every install hint mpigpu prints can be followed where no package index carries mpigpu (issue 46): it
names the packages themselves and an extra that pyproject.toml defines, never ``pip install mpigpu[...]``."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

from mpigpu.core._cuda import INSTALL_CUDA_EXTRA
from mpigpu.core.errors import install_hint

SOURCES = sorted((ROOT / "mpigpu").rglob("*.py"))


def _extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_every_hinted_extra_exists() -> None:
    named = {m for path in SOURCES for m in re.findall(r"install_hint\(\s*\"(\w+)\"", path.read_text())}
    named |= {m for path in SOURCES for m in re.findall(r"install_hint\(\s*'(\w+)'", path.read_text())}
    assert {"plot", "mpi", "cuda12", "cuda13"} <= named, named
    assert named <= _extras(), named - _extras()


def test_no_hint_needs_mpigpu_on_an_index() -> None:
    for path in SOURCES:
        assert not re.search(r"mpigpu\[\w+\]", path.read_text()), f"{path} tells users to pip install mpigpu[...]"


def test_the_hint_names_the_packages_and_the_clone_s_extra() -> None:
    assert (
        install_hint("plot", "matplotlib") == "pip install matplotlib (from a clone of mpigpu: pip install '.[plot]')"
    )
    assert "cupy-cuda12x" in INSTALL_CUDA_EXTRA and "'.[cuda13]'" in INSTALL_CUDA_EXTRA
