"""Module paths that earlier docs, samples and layouts showed, kept working by one mechanism.

Each old path is a row of ``MOVED``. A finder at the end of ``sys.meta_path`` (installed by ``import
mpigpu``; it only answers for these names, after every real module was looked for) makes each one
on import: a module that warns, with a DeprecationWarning at the user's import line naming the new
import, and reads each name from the new modules when first used. An old command name
(``python -m mpigpu.soak``) runs the new command's ``main()``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = ["MOVED", "Moved", "install"]


class Moved(NamedTuple):
    """Where an old module path's names live now."""

    new: Sequence[str]  # the modules that hold its names, looked up in order
    use: str = ""  # the import to write instead ("" : "import from <new>")
    command: str = ""  # for an old command name: the module whose main() ``python -m`` runs


MOVED: dict[str, Moved] = {
    # the 2026-11-25 layout (issue 30)
    "mpigpu._mpi": Moved(("mpigpu.core._mpi",), "use `from mpi4py import MPI` and MPI.COMM_WORLD"),
    "mpigpu.arrays": Moved(("mpigpu.core.arrays",)),
    "mpigpu.averager": Moved(("mpigpu.training.averager", "mpigpu.training.buckets"), "from mpigpu import Averager"),
    "mpigpu.config": Moved(("mpigpu.core.config",)),
    "mpigpu.failsafe": Moved(("mpigpu.job.failsafe",), "call mpigpu.install_abort_handler()"),
    "mpigpu.plan": Moved(("mpigpu.runtime.plan", "mpigpu.runtime.tuning")),
    "mpigpu.integrations": Moved(("mpigpu.training",)),
    "mpigpu.integrations.torch": Moved(("mpigpu.training.torch",), "from mpigpu import BackwardAverager"),
    "mpigpu.bench_training": Moved(
        ("mpigpu.bench.training",), "python -m mpigpu.bench.training", "mpigpu.bench.training"
    ),
    "mpigpu.benchmark": Moved(("mpigpu.bench.main",), "python -m mpigpu.bench", "mpigpu.bench.main"),
    "mpigpu.soak": Moved(("mpigpu.bench.soak",), "python -m mpigpu.bench.soak", "mpigpu.bench.soak"),
    # the calls in one package (issue 36)
    "mpigpu.api": Moved(("mpigpu.calls.reduce",), "from mpigpu import allreduce"),
    "mpigpu.records": Moved(("mpigpu.calls.keys", "mpigpu.calls.pipeline")),
    "mpigpu.collectives": Moved(("mpigpu.calls.move", "mpigpu.calls.pipeline"), "from mpigpu import broadcast"),
    "mpigpu.exchange": Moved(("mpigpu.calls.reduce", "mpigpu.calls.move"), "from mpigpu import reduce_scatter"),
    "mpigpu.handles": Moved(("mpigpu.calls.handles", "mpigpu.calls.reduce"), "from mpigpu import allreduce_async"),
    "mpigpu.persistent": Moved(("mpigpu.calls.persistent",), "from mpigpu import allreduce_init"),
    "mpigpu.objects": Moved(("mpigpu.calls.objects",), "from mpigpu import broadcast_object"),
    "mpigpu.ipc": Moved(("mpigpu.calls.ipc",), "from mpigpu import ipc_buffer"),
}

_MISSING = object()


def _finder_of(old: str, moved: Moved) -> Callable[[str], Any]:
    """The old module's ``__getattr__``: each name from the new modules, in order."""

    def find(name: str) -> Any:
        for module in moved.new:
            value = getattr(importlib.import_module(module), name, _MISSING)
            if value is not _MISSING:
                return value
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {' and '.join(moved.new)})")

    return find


class _Loader(importlib.abc.Loader):
    """Makes an old path's module; for ``python -m OLD``, the new command's code."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        moved = MOVED[old]
        instead = moved.use or f"import from {' or '.join(moved.new)}"
        warnings.warn(
            f"{old} moved to {' and '.join(moved.new)}: {instead}. The old path is kept so that programs written "
            "against earlier documentation keep working.",
            DeprecationWarning,
            stacklevel=2,  # the import statement (the warnings module skips importlib's own frames)
        )
        module.__getattr__ = _finder_of(old, moved)  # type: ignore[attr-defined]

    def get_code(self, fullname: str) -> types.CodeType:
        """``python -m`` an old command name: warn, then run the new command's main()."""
        moved = MOVED[fullname]
        if not moved.command:
            raise ImportError(f"{fullname} is not a command; it moved to {' and '.join(moved.new)}")
        source = (
            "import sys, warnings\n"
            f"warnings.warn({fullname!r} ' is an old name: run ' {moved.use!r}, DeprecationWarning, stacklevel=1)\n"
            f"from {moved.command} import main\n"
            "sys.exit(main())\n"
        )
        return compile(source, f"<{fullname}: {moved.use}>", "exec")

    def is_package(self, fullname: str) -> bool:
        return any(name.startswith(fullname + ".") for name in MOVED)


class _Finder(importlib.abc.MetaPathFinder):
    """Answers for the old paths in ``MOVED`` only."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        loader = _Loader()
        return importlib.machinery.ModuleSpec(fullname, loader, is_package=loader.is_package(fullname))


_FINDER = _Finder()


def install() -> None:
    """Put the finder at the end of ``sys.meta_path`` (idempotent): real modules are always found first."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
