"""Module paths that the docs or samples ever showed keep working (issue 30: the 2026-11-25 layout
move dropped ``mpigpu.integrations.torch``, which docs/training.md and samples/torch_data_parallel.py
taught): each old path imports, warns naming the new import, and gives the same objects. The list
comes from ``git log -p --all -- docs README.md samples``; the imports the docs show today are
checked too."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings

import pytest
from conftest import ROOT

# (old module, a name the docs imported from it, where that name lives now)
OLD_PATHS = [
    ("mpigpu.integrations.torch", "BackwardAverager", "mpigpu.training.torch"),
    ("mpigpu.failsafe", "abort_on_exception", "mpigpu.job.failsafe"),
    ("mpigpu._mpi", "world", "mpigpu.core._mpi"),
    ("mpigpu.config", "parse_count", "mpigpu.core.config"),
    ("mpigpu.averager", "Averager", "mpigpu.training.averager"),
    ("mpigpu.arrays", "raw_view", "mpigpu.core.arrays"),
    ("mpigpu.plan", "machine_signature", "mpigpu.runtime.tuning"),
    # the calls in one package (issue 36)
    ("mpigpu.api", "allreduce", "mpigpu.calls.reduce"),
    ("mpigpu.records", "call_key", "mpigpu.calls.keys"),
    ("mpigpu.collectives", "broadcast", "mpigpu.calls.move"),
    ("mpigpu.exchange", "scatter_rows", "mpigpu.calls.reduce"),
    ("mpigpu.exchange", "alltoall", "mpigpu.calls.move"),
    ("mpigpu.handles", "allreduce_async", "mpigpu.calls.reduce"),
    ("mpigpu.persistent", "allreduce_init", "mpigpu.calls.persistent"),
    ("mpigpu.objects", "broadcast_object", "mpigpu.calls.objects"),
    ("mpigpu.ipc", "ipc_buffer", "mpigpu.calls.ipc"),
]


@pytest.mark.parametrize(("old", "name", "new"), OLD_PATHS, ids=[f"{old}.{name}" for old, name, _ in OLD_PATHS])
def test_an_old_path_imports_warns_and_gives_the_same_object(
    monkeypatch: pytest.MonkeyPatch, old: str, name: str, new: str
) -> None:
    parent = old.rpartition(".")[0]
    for name_ in (old, parent):  # the warning comes with the first import (a moved parent warns too)
        if name_ != "mpigpu":
            monkeypatch.delitem(sys.modules, name_, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    messages = [str(w.message) for w in caught]
    assert all(w.category is DeprecationWarning and " moved to " in str(w.message) for w in caught), messages
    assert any(re.match(rf"^{re.escape(old)} moved to .*{re.escape(new)}", m) for m in messages), messages
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="moved to"):
        module.no_such_name  # noqa: B018


def test_the_warning_names_the_new_import_at_the_users_line() -> None:
    """Python shows a DeprecationWarning by default only when it is attributed to __main__: the
    warning must point at the user's import, not at mpigpu or importlib."""
    code = "from mpigpu.integrations.torch import BackwardAverager\nassert BackwardAverager.__name__\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "<string>:1: DeprecationWarning: mpigpu.integrations.torch moved to mpigpu.training.torch" in done.stderr
    assert "from mpigpu import BackwardAverager" in done.stderr


def _documented_imports() -> set[tuple[str, str | None]]:
    """(module, name or None) of every ``from mpigpu... import name`` and ``import mpigpu...`` line in
    the README, docs/ and samples/."""
    found: set[tuple[str, str | None]] = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "samples").glob("*.py"))]:
        for module, names in re.findall(r"^\s*from (mpigpu[\w.]*) import ([\w, ]+)$", path.read_text(), re.M):
            found |= {(module, name.strip()) for name in names.split(",") if name.strip()}
        found |= {(m, None) for m in re.findall(r"^\s*import (mpigpu[\w.]*)", path.read_text(), re.M)}
    return found


@pytest.mark.parametrize(("module", "name"), sorted(_documented_imports(), key=str))
def test_every_import_the_docs_show_works(module: str, name: str | None) -> None:
    imported = importlib.import_module(module)
    if name is not None:
        assert hasattr(imported, name), f"from {module} import {name}"
