"""Pieces shared by the commands (average, bench, soak, bench_training, info): argument types that
explain bad values, the ``#`` header (library versions, one line per rank), version collection, the
one-line error of a command that cannot run, and the JSON writer."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from mpigpu._version import __version__
from mpigpu.backends import BACKEND_NAMES
from mpigpu.core._mpi import launcher_rank
from mpigpu.core.config import parse_count
from mpigpu.core.dtypes import DTYPES, parse_dtype
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import parse_op

__all__ = [
    "Parser",
    "backend_arg",
    "choice_arg",
    "comma_list",
    "count_arg",
    "dtype_arg",
    "header_lines",
    "launcher_rank",
    "nonneg_int",
    "op_arg",
    "parse_command",
    "positive_int",
    "prog",
    "refuse",
    "seconds_arg",
    "versions",
    "write_json",
]


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad option once per job (rank 0) and, under a launcher, ends the whole job."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=f"mpigpu {__version__}")

    def error(self, message: str) -> Any:  # type: ignore[override]
        if launcher_rank() <= 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        if launcher_rank() >= 0:  # ranks whose own options were valid (MPMD launch) must not wait for this one
            from mpigpu.job.failsafe import abort_before_start

            abort_before_start(2, f"{self.prog}: error: {message}")
        self.exit(2)


def parse_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """A command's options, parsed; from then on one rank's unhandled exception ends the whole job
    with its message, rather than leaving the other ranks waiting (``failsafe.abort_on_exception``)."""
    args = parser.parse_args(argv)
    from mpigpu.job.failsafe import abort_on_exception

    abort_on_exception()
    return args


def prog(module: str) -> str:
    """argparse's prog, as the user typed it: ``python3 -m mpigpu.average``."""
    return f"{os.path.basename(sys.executable) or 'python'} -m {module}"


def _wrap(func: Any, what: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return func(text)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = what
    return parse


count_arg = _wrap(lambda t: parse_count(t, what="size"), "size")
dtype_arg = _wrap(lambda t: parse_dtype(t).name, "dtype")
op_arg = _wrap(lambda t: parse_op(t).value, "op")


def _int(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is too small: it must be >= {minimum}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1)


def nonneg_int(text: str) -> int:
    return _int(text, 0)


def seconds_arg(text: str) -> float:
    """A duration in seconds: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def choice_arg(choices: Sequence[str], what: str) -> Callable[[str], str]:
    """An argparse type that takes one of ``choices`` and names them all when given anything else."""

    def parse(text: str) -> str:
        if text in choices:
            return text
        raise argparse.ArgumentTypeError(f"unknown {what} {text!r}: use {', '.join(choices)}")

    parse.__name__ = what
    return parse


def comma_list(parse_one: Callable[[str], Any], what: str, everything: Iterable[str] = ()) -> Callable[[str], list]:
    """An argparse type for a comma-separated list, each item read by ``parse_one``, duplicates
    dropped; ``all`` expands to ``everything`` where that is given."""

    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if items == ["all"] and everything:
            items = list(everything)
        if not items:
            raise argparse.ArgumentTypeError(f"empty list of {what}")
        return list(dict.fromkeys(parse_one(item) for item in items))

    parse.__name__ = what
    return parse


backend_arg = choice_arg(["auto", *BACKEND_NAMES], "backend")


DTYPE_HELP = f"element type: {', '.join(DTYPES)}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    """Versions of Python and of every package that matters to a result."""
    found = {"python": platform.python_version()}
    for dist in (
        "mpigpu", "numpy", "mpi4py", "mpich", "ml_dtypes", "cuda-core", "cuda-bindings",
        "cupy-cuda12x", "cupy-cuda13x", "nvidia-nccl-cu12", "nvidia-nccl-cu13", "torch", "jax",
    ):  # fmt: skip
        version = _version(dist)
        if version:
            found[dist] = version
    return found


def gpu_names() -> list[str]:
    """The model of each GPU ``nvidia-smi`` lists, in its order (none where it is missing or fails)."""
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    try:
        listed = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, document: Any) -> None:
    """Write a command's JSON document (indented, one trailing newline), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def refuse(module: str, problem: Exception | str, rank: int = 0) -> int:
    """A command that cannot run as asked: one line on rank 0, in argparse's form, and exit status 2.

    Only for a problem every rank finds alike (options, what the job has): the ranks then all
    return without a collective left waiting."""
    if rank == 0:
        sys.stderr.write(f"{prog(module)}: error: {problem}\n")
        sys.stderr.flush()
    return 2


def require_gpu(script: str, framework: str = "cupy") -> None:
    """Exit with status 2 and one line (first launched rank) unless ``framework`` and a CUDA GPU are
    here: a GPU-only script on a machine without them says so instead of a ModuleNotFoundError."""
    import importlib.util

    from mpigpu.core._cuda import INSTALL_CUDA_EXTRA, visible_device_count

    missing = [name for name in dict.fromkeys((framework, "cupy")) if importlib.util.find_spec(name) is None]
    if missing:
        problem = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed"
    elif visible_device_count() == 0:
        problem = "no CUDA GPU is visible to this process"
    else:
        return
    if launcher_rank() <= 0:
        sys.stderr.write(
            f"{script} needs a CUDA GPU and the CUDA extra ({problem}): on a GPU machine, {INSTALL_CUDA_EXTRA}\n"
        )
    raise SystemExit(2)


def header_lines(ctx: Any) -> list[str]:
    """The ``#`` header (collective; meaningful on rank 0): library, ranks, one line per rank."""
    layout, lib = ctx.layout, ctx.mpi_lib
    gpu = ctx.gpu.describe() if ctx.gpu else "cpu"
    mine = f"host {layout.hostnames[ctx.rank]:<16} node {layout.node_index} local {layout.local_rank}  {gpu}"
    lines = ctx.comm.gather(mine, root=0) or []
    nodes = f"{layout.num_nodes} node{'s' if layout.num_nodes != 1 else ''}"
    if layout.virtual:
        nodes += f" (virtual, MPIGPU_NODE_SIZE={ctx.settings.node_size})"
    head = [
        f"# mpigpu {__version__} | {lib.version} (MPI {lib.standard}) | {ctx.size} rank"
        f"{'s' if ctx.size != 1 else ''} on {nodes} | Python {platform.python_version()}",
        f"# CUDA-aware MPI: {ctx.cuda_aware.describe()} | NCCL: "
        + (ctx.nccl.version if ctx.nccl.available else f"no ({ctx.nccl.reason})"),
    ]
    return head + [f"#  Rank {r:3d} {line}" for r, line in enumerate(lines)]
