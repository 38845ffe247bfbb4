"""``mpiexec -n N python -m mpigpu.bench``: the allreduce benchmark (``mpigpu.benchmark`` too).

Sweeps message sizes (8 B to 1 GiB by default) over every available mpigpu backend and the raw
anchor each one has to beat (``mpigpu.anchors``), in place and out of place, for the chosen dtypes
and ops. Every path is verified at every size before it is timed (nccl-tests' check, with the
'exact' pattern); a single wrong element makes the exit status 1. Rank 0 prints one fixed-width
table per path and group, and can write JSON (--json), a plot (--plot) and a crossover table for
``backend="auto"`` (--tune); ``--compare A.json B.json`` prints the ratios between two runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpigpu.anchors import ANCHORS, anchor_for
from mpigpu.backends import BACKEND_NAMES
from mpigpu.cli import Parser, count_arg, dtype_arg, header_lines, nonneg_int, now, positive_int, prog, versions
from mpigpu.dtypes import DTYPES, DType
from mpigpu.errors import InvalidArgument, MpigpuError
from mpigpu.ops import Op, parse_op
from mpigpu.timing import Result
from mpigpu.tune import size_label

__all__ = ["Measurement", "PathSpec", "build_parser", "main", "run", "size_list"]

TARGET_REP_S = 0.05  # adaptive iteration count: about this long per repetition
MAX_ITERS = 1000
AUTO_TARGET = 1.05  # the target: auto within 5% of the fastest backend
PLACE_LABEL = {"device": "gpu", "host": "host"}
PATH_NAMES = ("auto", *BACKEND_NAMES, *ANCHORS)
# environment variables that change results, recorded in the JSON
_ENV_PREFIXES = ("MPIGPU_", "NCCL_", "I_MPI_", "MPIR_CVAR_", "MPICH_", "OMPI_", "UCX_", "CUDA_VISIBLE_DEVICES")


# -- options ------------------------------------------------------------------------------------
def _listing(parse_one: Callable[[str], Any], what: str, everything: Iterable[str] = ()) -> Callable[[str], list]:
    """An argparse type for a comma-separated list; ``all`` expands to ``everything``."""

    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if items == ["all"] and everything:
            items = list(everything)
        if not items:
            raise argparse.ArgumentTypeError(f"empty list of {what}")
        values = [parse_one(item) for item in items]
        return list(dict.fromkeys(values))

    parse.__name__ = what
    return parse


def _op_name(text: str) -> str:
    try:
        return parse_op(text).value
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _path_name(text: str) -> str:
    if text in PATH_NAMES:
        return text
    raise argparse.ArgumentTypeError(f"unknown backend or anchor {text!r}: use {', '.join(PATH_NAMES)}")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def build_parser() -> Parser:
    parser = Parser(
        prog=prog("mpigpu.bench"),
        description=(
            "Time allreduce over a range of message sizes for every available mpigpu backend and the raw\n"
            "anchors beside them (nccl-raw, seed-staging, mpi-device, mpi-host). Every path is verified at\n"
            "every size before it is timed. Run it under your launcher:\n"
            "  mpiexec -n 4 python -m mpigpu.bench --max-bytes 64M --json run.json --plot run.png"
        ),
        epilog="time = mean per call on the slowest rank; median and spread over repetitions; algbw = bytes/time;\n"
        "busbw = algbw * 2(n-1)/n (nccl-tests). exit status: 0 if every element was right, 1 if any was\n"
        "wrong, 2 for invalid options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sizes = parser.add_argument_group("sizes")
    sizes.add_argument("--min-bytes", "-b", type=count_arg, default=8, metavar="SIZE", help="smallest (default 8)")
    sizes.add_argument(
        "--max-bytes", "-e", type=count_arg, default=1 << 30, metavar="SIZE", help="largest (default 1G)"
    )
    sizes.add_argument("--step-factor", "-f", type=positive_int, default=2, metavar="F", help="size step (default 2)")
    what = parser.add_argument_group("what to time")
    what.add_argument(
        "--dtypes", type=_listing(dtype_arg, "dtypes", DTYPES), default=["float32"], metavar="LIST",
        help=f"comma-separated element types or 'all' (default float32): {', '.join(DTYPES)}",
    )  # fmt: skip
    what.add_argument(
        "--ops", type=_listing(_op_name, "ops", [o.value for o in Op]), default=["sum"], metavar="LIST",
        help="comma-separated reductions or 'all' (default sum, as nccl-tests)",
    )  # fmt: skip
    what.add_argument(
        "--backends", type=_listing(_path_name, "backends"), default=None, metavar="LIST",
        help="comma-separated backends, anchors and/or auto (default: every available backend and anchor); "
        "a backend always brings its anchor",
    )  # fmt: skip
    what.add_argument(
        "--placement", choices=["auto", "gpu", "host", "both"], default="auto",
        help="where the buffers live: auto = GPU and host buffers when every rank has a GPU, host otherwise",
    )  # fmt: skip
    what.add_argument("--inplace", action="store_true", help="time in-place calls only")
    what.add_argument("--out-of-place", action="store_true", help="time out-of-place calls only")
    timing = parser.add_argument_group("timing")
    timing.add_argument(
        "--iters", "-n", type=positive_int, default=None, metavar="N",
        help=f"timed calls per repetition (default: adaptive, about {TARGET_REP_S * 1e3:g} ms per repetition, "
        f"1 to {MAX_ITERS})",
    )  # fmt: skip
    timing.add_argument("--warmup", "-w", type=nonneg_int, default=5, metavar="N", help="untimed calls (default 5)")
    timing.add_argument("--repeats", type=positive_int, default=3, metavar="N", help="repetitions (default 3)")
    timing.add_argument(
        "--time-limit", type=_seconds, default=60.0, metavar="S",
        help="stop a path's sweep before a size that would take longer than S seconds (default 60; 0 = none)",
    )  # fmt: skip
    output = parser.add_argument_group("output")
    output.add_argument("--json", type=Path, metavar="PATH", help="write every figure and the machine as JSON")
    output.add_argument("--plot", type=Path, metavar="PNG", help="plot busbw and time against size (matplotlib)")
    output.add_argument(
        "--tune", "--autotune", action="store_true",
        help="write the fastest backend per size band into the tuning table (MPIGPU_TUNE_FILE), then time auto",
    )  # fmt: skip
    output.add_argument(
        "--compare", nargs=2, type=Path, metavar=("A", "B"), help="print the ratios between two JSON runs and exit"
    )
    output.add_argument("--replot", type=Path, metavar="JSON", help="redraw --plot from a JSON run and exit")
    output.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--corrupt", type=nonneg_int, default=0, metavar="N", help=argparse.SUPPRESS
    )  # testing aid: damage N results on rank 0 before every check
    return parser


def _check_args(parser: Parser, args: argparse.Namespace) -> None:
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.step_factor < 2:
        parser.error("--step-factor must be >= 2")
    if args.replot is not None and args.plot is None:
        parser.error("--replot needs --plot PATH.png")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'mpigpu[plot]'")


def size_list(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min_bytes, min_bytes*factor, ... up to max_bytes."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


# -- paths --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PathSpec:
    """One thing to time: an mpigpu backend, an anchor, or auto, on GPU buffers or host arrays."""

    name: str
    kind: str  # "backend", "anchor" or "auto"
    placement: str  # "device" or "host"
    anchor: str | None = None  # backends: the anchor reported beside it

    @property
    def label(self) -> str:
        return f"{self.name} ({PLACE_LABEL[self.placement]})"


@dataclass(frozen=True)
class Measurement:
    """One path at one size: the Result plus how it was obtained."""

    path: PathSpec
    result: Result
    api_us: float | None  # backends: full allreduce() calls (prepare + check + run), mean per call
    iters: int
    warmup: int
    repeats: int
    seconds: float  # wall time spent on this size, slowest rank
    check_seconds: float  # of which filling, the checked call and verifying every element
    chosen: str | None = None  # auto: the backend it picked
    reason: str | None = None  # auto: why
    best: str | None = None  # auto: the fastest backend of the sweep at this size...
    best_us: float | None = None  # ...re-timed (median) right after auto, so drift cannot bias the ratio

    @property
    def key(self) -> tuple[str, str, str, bool, int]:
        r = self.result
        return (self.path.placement, r.dtype, r.op, r.inplace, r.bytes)

    def to_dict(self) -> dict[str, Any]:
        data = self.result.to_dict()
        data.update(
            path=self.path.name, kind=self.path.kind, placement=self.path.placement, anchor=self.path.anchor,
            api_us=self.api_us, iters=self.iters, warmup=self.warmup, repeats=self.repeats,
            seconds=round(self.seconds, 4), check_seconds=round(self.check_seconds, 4),
            chosen=self.chosen, chosen_reason=self.reason, best=self.best, best_us=self.best_us,
            ok=self.result.wrong == 0,
        )  # fmt: skip
        return data


def _placements(args: argparse.Namespace, ctx: Any) -> list[str]:
    if args.placement in ("gpu", "both") and not ctx.all_have_gpus:
        raise InvalidArgument(f"--placement {args.placement}: not every rank has a GPU (see python -m mpigpu.info)")
    return {
        "gpu": ["device"],
        "host": ["host"],
        "both": ["device", "host"],
        "auto": ["device", "host"] if ctx.all_have_gpus else ["host"],
    }[args.placement]


def plan_paths(ctx: Any, args: argparse.Namespace) -> tuple[list[PathSpec], list[str]]:
    """The paths to time, in order (anchors before the backends that refer to them, auto last),
    and a line for each one that cannot run here."""
    from mpigpu.backends import backend_class

    wanted = set(args.backends or [*BACKEND_NAMES, *ANCHORS])
    skipped: list[str] = []
    backends = []
    for name in BACKEND_NAMES:
        if name not in wanted:
            continue
        available = ctx.availability[name]
        if available.ok:
            backends.append(name)
        else:
            skipped.append(f"{name}: {available.reason}")
    paths: list[PathSpec] = []
    for placement in _placements(args, ctx):
        mine = []
        for name in backends:
            cls = backend_class(name)
            if cls.device_arrays if placement == "device" else cls.host_arrays:
                mine.append(PathSpec(name, "backend", placement, anchor_for(placement, name)))
        needed = {p.anchor for p in mine} | {a for a in wanted if a in ANCHORS}
        for name, cls in ANCHORS.items():
            if name in needed and cls.placement == placement:
                problem = cls.unavailable(ctx)
                if problem is None:
                    paths.append(PathSpec(name, "anchor", placement))
                elif f"{name}: {problem}" not in skipped:
                    skipped.append(f"{name}: {problem}")
        paths.extend(mine)
        if "auto" in wanted and not args.tune:
            paths.append(PathSpec("auto", "auto", placement))
    return paths, skipped


def _unsupported(ctx: Any, path: PathSpec, dtype: DType, op: Op) -> str | None:
    from mpigpu.backends import backend_class

    if path.kind == "anchor":
        return ANCHORS[path.name].supports(dtype, op)
    if path.kind == "backend":
        return backend_class(path.name).supports(dtype, op)
    return None


# -- measuring ----------------------------------------------------------------------------------
def _sized(work: Any, count: int, op: Op, inplace: bool) -> Any:
    """The workload's buffers (allocated once at the largest size) seen as ``count`` elements."""
    view = copy.copy(work)
    view.count, view.op, view.inplace = count, op, inplace

    def prefix(v: Any) -> Any:
        return dataclasses.replace(v, shape=(count,), host=None if v.host is None else v.host[:count])

    view.x = prefix(work.x)
    view.out = view.x if inplace else prefix(work.out)
    return view


class Sweep:
    """Runs the measurements of one benchmark (collective: every rank runs the same sequence)."""

    def __init__(self, ctx: Any, args: argparse.Namespace) -> None:
        self.ctx, self.args, self.comm = ctx, args, ctx.comm
        self.rank = ctx.rank
        self.stopped: list[str] = []
        self.unsupported: list[str] = []
        self.measurements: list[Measurement] = []
        self.rechecks: list[Measurement] = []  # fastest backends re-timed beside auto
        self._anchors: dict[str, Any] = {}
        self.cp_stream: Any = None
        self.stream: Any = None  # StreamRef of cp_stream
        if ctx.all_have_gpus:
            from mpigpu._cuda import StreamRef, cupy

            ctx.activate_gpu()
            self.cp_stream = cupy().cuda.Stream(non_blocking=True)
            self.stream = StreamRef(int(self.cp_stream.ptr))

    def close(self) -> None:
        for anchor in self._anchors.values():
            anchor.close()
        self._anchors.clear()

    def _anchor(self, name: str) -> Any:
        anchor = self._anchors.get(name)
        if anchor is None:
            cls = ANCHORS[name]
            anchor = self._anchors[name] = cls(self.ctx, self.cp_stream if cls.placement == "device" else None)
        return anchor

    def _max(self, value: float) -> float:
        from mpigpu._mpi import MPI

        return float(self.comm.allreduce(float(value), op=MPI().MAX))

    def progress(self, text: str) -> None:
        if self.rank == 0 and not self.args.quiet:
            sys.stderr.write(f"[bench] {text}\n")
            sys.stderr.flush()

    def workload(self, placement: str, dtype: DType, count: int) -> Any:
        from mpigpu.workload import Workload

        device = placement == "device"
        if device:
            self.ctx.activate_gpu()
        return Workload(
            count=count, dtype=dtype, op=Op.SUM, pattern="exact", rank=self.rank, nranks=self.ctx.size,
            device=self.ctx.gpu if device else None, inplace=False not in self.args.modes,
            stream=self.stream if device else None,
        )  # fmt: skip

    def sweep_group(self, paths: list[PathSpec], placement: str, dtype: DType, ops: list[Op]) -> list[Measurement]:
        """Every path of one placement and dtype, for each op, mode and size."""
        counts = sorted({max(1, size // dtype.itemsize) for size in self.args.sizes})
        work = self.workload(placement, dtype, counts[-1])
        found = []
        try:
            for op in ops:
                for path in paths:
                    problem = _unsupported(self.ctx, path, dtype, op)
                    if problem is not None:
                        self.unsupported.append(f"{path.label} {dtype.name} {op.value}: {problem}")
                        continue
                    for inplace in self.args.modes:
                        found.extend(self._sweep_path(path, work, counts, op, inplace))
        finally:
            work.free()
        return found

    def _sweep_path(self, path: PathSpec, work: Any, counts: list[int], op: Op, inplace: bool) -> list[Measurement]:
        found: list[Measurement] = []
        mode = "in-place" if inplace else "out-of-place"
        what = f"{path.name} {PLACE_LABEL[path.placement]} {work.dtype.name} {op.value} {mode}"
        limit = self.args.time_limit
        for i, count in enumerate(counts):
            sized = _sized(work, count, op, inplace)
            m = self.measure(path, sized, op, inplace)
            if m is None:
                break
            top = _fastest_backends(self.measurements).get(m.key) if path.kind == "auto" else None
            if top is not None:
                again = self.measure(top.path, sized, op, inplace)
                if again is not None:
                    self.rechecks.append(again)
                    m = dataclasses.replace(m, best=top.path.name, best_us=_median(again))
            found.append(m)
            self.measurements.append(m)
            wrong = f", {m.result.wrong} WRONG" if m.result.wrong else ""
            chosen = f" -> {m.chosen}" if m.chosen else ""
            self.progress(
                f"{what} {size_label(m.result.bytes)} ({i + 1}/{len(counts)}){chosen}: "
                f"{m.result.median_us:.2f} us{wrong}"
            )
            if limit and 0 < i < len(counts) - 1:
                # The least the next size costs: the check, the estimate and one timed call per
                # repetition. Not judged from the first size, whose check carries one-time set-up
                # (kernel compilation, communicator creation) that does not grow with the size.
                growth = counts[i + 1] / count
                per_call = (m.result.median_us or m.result.time_us) * 1e-6 * growth
                predicted = m.check_seconds * growth + per_call * (1 + m.repeats + (m.api_us is not None))
                if m.seconds > limit or predicted > limit:
                    why = f"took {m.seconds:.3g} s" if m.seconds > limit else f"the next would take ~{predicted:.3g} s"
                    note = f"{what}: stopped after {size_label(m.result.bytes)} ({why}; --time-limit {limit:g} s)"
                    self.stopped.append(note)
                    self.progress(note)
                    break
        return found

    def measure(self, path: PathSpec, work: Any, op: Op, inplace: bool) -> Measurement | None:
        """Verify, then time, one path at one size; None if the path refuses this call."""
        from mpigpu.api import allreduce, prepare, run
        from mpigpu.timing import max_over_ranks, max_phases_over_ranks, summarize, time_calls
        from mpigpu.verify import total_wrong

        args, comm = self.args, self.comm
        started = time.perf_counter()
        stream = self.stream if path.placement == "device" else None
        api_call = None
        chosen = reason = None
        if path.kind == "anchor":
            anchor = self._anchor(path.name)

            def call() -> Any:
                return anchor.allreduce(work.x, work.out, op)

        else:
            out = None if inplace else work.out
            try:
                prepared = prepare(work.x, op, out=out, comm=comm, backend=path.name, stream=stream)
            except MpigpuError as exc:  # raised alike on every rank (prepare checks across ranks)
                self.unsupported.append(f"{path.label} {work.dtype.name} {op.value} {work.count} elements: {exc}")
                return None
            if path.kind == "auto":
                chosen, reason = prepared.choice.backend, prepared.choice.reason

            def call() -> Any:
                return run(prepared)

            def api_call() -> Any:
                return allreduce(work.x, op, out=out, comm=comm, backend=path.name, stream=stream)

        def sync() -> None:
            if stream is not None:
                self.cp_stream.synchronize()

        # the check (nccl-tests' #wrong): fresh input, poisoned output, one call, every element
        work.fill()
        work.poison()
        call()
        if self.rank == 0:
            work.corrupt(args.corrupt)
        wrong = total_wrong(comm, work.wrong())
        check_seconds = self._max(time.perf_counter() - started)

        comm.Barrier()
        t0 = time.perf_counter()
        call()
        sync()
        estimate = self._max(time.perf_counter() - t0)
        iters = args.iters or max(1, min(MAX_ITERS, int(TARGET_REP_S / max(estimate, 1e-9))))
        warmup = max(1, min(args.warmup, iters))
        for _ in range(warmup - 1):
            call()
        means = time_calls(call, iters, barrier=comm.Barrier, stream=stream, repeats=args.repeats)
        mean, median, spread = summarize(means)
        time_us, per_rank = max_over_ranks(comm, mean)
        api_us = None
        if api_call is not None:
            api_us = self._max(time_calls(api_call, iters, barrier=comm.Barrier, stream=stream)[0])
        phases: dict[str, float] = {}
        if path.kind != "anchor":
            phases = max_phases_over_ranks(comm, self.ctx.backend(chosen or path.name).last_phases)
        result = Result(
            bytes=work.count * work.dtype.itemsize, elements=work.count, dtype=work.dtype.name, op=op.value,
            backend=path.name, ranks=self.ctx.size, time_us=time_us, wrong=wrong, inplace=inplace,
            median_us=self._max(median), spread_us=self._max(spread), phases_us=phases, per_rank_us=per_rank,
        )  # fmt: skip
        seconds = self._max(time.perf_counter() - started)
        return Measurement(path, result, api_us, iters, warmup, args.repeats, seconds, check_seconds, chosen, reason)


# -- tables -------------------------------------------------------------------------------------
_COLUMNS = (
    f"#{'size':>12} {'count':>11} {'type':>9} {'redop':>5} {'place':>5} {'time(us)':>10} {'median':>10} "
    f"{'spread':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>6}"
)
_BACKEND_COLUMNS = f" {'api(us)':>10} {'anchor(us)':>10} {'speedup':>7}"
_AUTO_COLUMNS = f" {'chosen':>10} {'best':>10} {'best(us)':>10} {'auto/best':>9}"


def _row(m: Measurement) -> str:
    r = m.result
    wrong = "N/A" if r.wrong < 0 else str(r.wrong)
    return (
        f" {r.bytes:>12} {r.elements:>11} {r.dtype:>9} {r.op:>5} {'in' if r.inplace else 'out':>5} "
        f"{r.time_us:>10.2f} {r.median_us or 0:>10.2f} {r.spread_us or 0:>9.2f} {r.algbw_gbps:>8.3f} "
        f"{r.busbw_gbps:>8.3f} {wrong:>6}"
    )


def _median(m: Measurement | None) -> float | None:
    return None if m is None else (m.result.median_us or m.result.time_us)


def _fastest_backends(measurements: Iterable[Measurement]) -> dict[tuple, Measurement]:
    """Per key (placement, dtype, op, mode, bytes): the fastest verified mpigpu backend (median)."""
    best: dict[tuple, Measurement] = {}
    for m in measurements:
        if m.path.kind == "backend" and m.result.wrong == 0:
            old = best.get(m.key)
            if old is None or (_median(m) or 0) < (_median(old) or 0):
                best[m.key] = m
    return best


def render_tables(found: list[Measurement], everything: list[Measurement]) -> list[str]:
    """One table per path for one group of measurements, anchors and fastest backends from ``everything``."""
    by_key = {(m.path.name, *m.key): m for m in everything}
    lines: list[str] = []
    order: dict[tuple[PathSpec, str, str], list[Measurement]] = {}
    for m in found:
        order.setdefault((m.path, m.result.dtype, m.result.op), []).append(m)
    for (path, dtype, op), rows in order.items():
        rows.sort(key=lambda m: (m.result.bytes, m.result.inplace))
        title = f"# {path.name}  [{'GPU buffers' if path.placement == 'device' else 'host arrays'}, {dtype}, {op}]"
        columns = _COLUMNS
        if path.kind == "backend":
            anchor = path.anchor or "none"
            title += f"  anchor: {anchor}" + (f" ({ANCHORS[anchor].description})" if anchor in ANCHORS else "")
            columns += _BACKEND_COLUMNS
        elif path.kind == "anchor":
            title += f"  {ANCHORS[path.name].description}"
        else:
            columns += _AUTO_COLUMNS
        lines += ["#", title, columns]
        for m in rows:
            line = _row(m)
            if path.kind == "backend":
                anchor_us = _median(by_key.get((path.anchor, *m.key))) if path.anchor else None
                api = f"{m.api_us:.2f}" if m.api_us is not None else "-"
                anchor_text = f"{anchor_us:.2f}" if anchor_us else "n/a"
                ratio = f"{anchor_us / _median(m):.2f}" if anchor_us and _median(m) else "n/a"
                line += f" {api:>10} {anchor_text:>10} {ratio:>7}"
            elif path.kind == "auto":
                top_us = f"{m.best_us:.2f}" if m.best_us else "n/a"
                ratio = f"{(_median(m) or 0) / m.best_us:.3f}" if m.best_us else "n/a"
                line += f" {m.chosen or '':>10} {m.best or 'n/a':>10} {top_us:>10} {ratio:>9}"
            lines.append(line)
        if path.kind == "auto":
            previous = None
            for m in rows:
                if m.chosen != previous:
                    lines.append(f"# auto from {size_label(m.result.bytes)}: {m.chosen} ({m.reason})")
                    previous = m.chosen
        busbw = [m.result.busbw_gbps for m in rows if m.result.busbw_gbps > 0]
        if busbw:
            lines.append(f"# avg busbw {sum(busbw) / len(busbw):.4g} GB/s")
    return lines


# -- the machine and the JSON document ------------------------------------------------------------
def _nvidia_topology() -> str | None:
    """``nvidia-smi topo -m`` (None where the command does not exist)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    return (done.stdout or done.stderr).strip() or None


def machine_info(ctx: Any) -> dict[str, Any]:
    """Hosts, GPUs and links of the job (collective; complete on rank 0)."""
    from mpigpu.plan import machine_signature

    gpu = ctx.gpu
    mine = {
        "host": socket.gethostname(),
        "gpu": None if gpu is None else {"index": gpu.index, "name": gpu.name, "pci_bus_id": gpu.pci_bus_id},
    }
    ranks = ctx.comm.gather(mine, root=0)
    signature = machine_signature(ctx)
    if ctx.rank != 0:
        return {}
    gpus = {(r["host"], r["gpu"]["pci_bus_id"]): r["gpu"]["name"] for r in ranks if r["gpu"]}
    layout = ctx.layout
    nodes = f"{layout.num_nodes} node{'s' if layout.num_nodes != 1 else ''}"
    topology = f"{ctx.size} ranks on {nodes} ({', '.join(map(str, layout.node_sizes))} per node), " + (
        f"{len(gpus)} GPUs, link {signature['link']}" if gpus else "no GPU"
    )
    return {
        "hostname": socket.gethostname(),
        "hostnames": sorted({r["host"] for r in ranks}),
        "gpu_model": ", ".join(sorted(set(gpus.values()))) or None,
        "gpu_count": len(gpus),
        "ranks": ranks,
        "topology": topology,
        "nvidia_smi_topo": _nvidia_topology(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "signature": signature,
    }


def _versions(ctx: Any) -> dict[str, Any]:
    from mpigpu._cuda import cuda_version

    found: dict[str, Any] = versions()
    lib = ctx.mpi_lib
    found.update(
        mpi_library=lib.name,
        mpi=lib.version,
        mpi_standard=lib.standard,
        nccl=ctx.nccl.version if ctx.nccl.available else None,
        cuda=(cuda_version() or None) if ctx.any_has_gpus else None,
    )
    return found


def _settings(ctx: Any, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "sizes": args.sizes,
        "min_bytes": args.min_bytes,
        "max_bytes": args.max_bytes,
        "step_factor": args.step_factor,
        "dtypes": args.dtypes,
        "ops": args.ops,
        "backends": args.backends,
        "placement": args.placement,
        "modes": ["in-place" if m else "out-of-place" for m in args.modes],
        "iters": args.iters if args.iters else f"adaptive ({TARGET_REP_S * 1e3:g} ms per repetition, <= {MAX_ITERS})",
        "warmup": args.warmup,
        "repeats": args.repeats,
        "time_limit_s": args.time_limit,
        "pattern": "exact",
        "tune": args.tune,
        "mpigpu": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(ctx.settings).items()},
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
    }


# -- tuning and auto ----------------------------------------------------------------------------
def _tune(ctx: Any, sweep: Sweep, args: argparse.Namespace, command: list[str]) -> dict[str, Any] | None:
    """Write the crossover table measured by ``sweep`` and make ``auto`` use it (collective)."""
    from mpigpu import __version__
    from mpigpu.plan import machine_signature, signature_key
    from mpigpu.tune import Sample, bands_from_samples, describe_bands, install

    samples = [
        Sample(m.path.placement, m.result.bytes, m.path.name, _median(m) or 0.0,
               (m.result.dtype, m.result.op, m.result.inplace), ok=m.result.wrong == 0)
        for m in sweep.measurements
        if m.path.kind == "backend"
    ]  # fmt: skip
    bands = bands_from_samples(samples)
    if not bands:
        if ctx.rank == 0:
            print("# --tune: no mpigpu backend was measured without errors; no table written")
        return None
    meta = {
        "created": now(), "command": " ".join(command), "ranks": ctx.size, "hostname": socket.gethostname(),
        "sizes": [min(args.sizes), max(args.sizes)], "mpigpu": __version__,
    }  # fmt: skip
    table = install(ctx, bands, meta)
    signature = machine_signature(ctx)
    info = {
        "file": str(ctx.settings.tune_path),
        "signature": signature,
        "key": signature_key(signature),
        "bands": {p: [[edge, name] for edge, name in entries] for p, entries in bands.items()},
        "applies": table.source if table else None,
    }
    if ctx.rank == 0:
        print("#")
        print(f"# tuned crossover table for {info['key']}")
        print(f"#   written to {info['file']}")
        for line in describe_bands(bands):
            print(f"#   {line}")
        sys.stdout.flush()
    return info


def _auto_summary(measurements: list[Measurement]) -> dict[str, Any] | None:
    """auto's median against the fastest backend's, re-timed beside it, at every size both ran."""
    rows = [((_median(m) or 0) / m.best_us, m) for m in measurements if m.path.kind == "auto" and m.best_us]
    if not rows:
        return None
    ratio, worst = max(rows, key=lambda row: row[0])
    r = worst.result
    return {
        "target": AUTO_TARGET,
        "sizes": len(rows),
        "within_target": sum(1 for row in rows if row[0] <= AUTO_TARGET),
        "worst_ratio": round(ratio, 4),
        "worst": {"bytes": r.bytes, "dtype": r.dtype, "op": r.op, "inplace": r.inplace,
                  "placement": worst.path.placement, "chosen": worst.chosen, "fastest": worst.best},
    }  # fmt: skip


# -- plot and compare (from the JSON document) --------------------------------------------------
def _title(doc: dict[str, Any]) -> str:
    machine, ver = doc.get("machine") or {}, doc.get("versions") or {}
    gpus = f"{machine['gpu_count']} x {machine['gpu_model']}" if machine.get("gpu_model") else "no GPU (CPU only)"
    return (
        f"mpigpu allreduce on {machine.get('hostname', '?')}: {doc.get('ranks')} ranks, {gpus}, "
        f"{ver.get('mpi_library', 'MPI')} ({str(doc.get('date', ''))[:10]})"
    )


def _group_label(group: tuple[str, str, str, bool]) -> str:
    placement, dtype, op, inplace = group
    where = "GPU buffers" if placement == "device" else "host arrays"
    return f"{where}, {dtype} {op}, {'in-place' if inplace else 'out-of-place'}"


def plot(doc: dict[str, Any], path: Path) -> None:
    """busbw and time against size (log axes), one line per backend and anchor, one row per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows = doc["results"]
    groups = list(dict.fromkeys((r["placement"], r["dtype"], r["op"], r["inplace"]) for r in rows))
    names = list(dict.fromkeys(r["path"] for r in rows))
    colour: dict[str, int] = {}
    for r in rows:  # one colour per backend; an anchor takes the colour of its first backend
        if r["kind"] != "anchor":
            colour.setdefault(r["path"], len(colour))
    for r in rows:
        if r["kind"] == "backend" and r.get("anchor") and r["anchor"] not in colour:
            colour[r["anchor"]] = colour[r["path"]]
    for name in names:
        colour.setdefault(name, len(set(colour.values())))
    colours = plt.get_cmap("tab10")
    styles = {"backend": ("-", "o"), "anchor": ("--", "s"), "auto": (":", "^")}
    use_busbw = (doc.get("ranks") or 1) > 1
    fig, axes = plt.subplots(len(groups), 2, figsize=(14, 4.6 * len(groups)), squeeze=False)
    sizes = FuncFormatter(lambda value, _: size_label(int(value)) if value >= 1 else "")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for (left, right), group in zip(axes, groups, strict=True):
        for name in names:
            points = sorted(
                (r for r in rows if r["path"] == name and (r["placement"], r["dtype"], r["op"], r["inplace"]) == group),
                key=lambda r: r["bytes"],
            )
            if not points:
                continue
            kind = points[0]["kind"]
            line, marker = styles.get(kind, ("-", "o"))
            label = name + (" (anchor)" if kind == "anchor" else "")
            style = {"linestyle": line, "marker": marker, "markersize": 3, "color": colours(colour[name] % 10)}
            x = [r["bytes"] for r in points]
            bw = [r["busbw_gbps"] if use_busbw else r["algbw_gbps"] for r in points]
            left.plot(*zip(*[(a, b) for a, b in zip(x, bw, strict=True) if b > 0], strict=True), label=label, **style)
            right.plot(x, [r["median_us"] or r["time_us"] for r in points], label=label, **style)
        bw_label = "busbw (GB/s)" if use_busbw else "algbw (GB/s)"
        for ax, ylabel in ((left, bw_label), (right, "time per call, median (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(sizes)
            ax.yaxis.set_major_formatter(plain)
            low, high = ax.get_ylim()
            ax.yaxis.set_minor_formatter(plain if high < 10 * low else NullFormatter())  # label minors in 1 decade
            ax.set_xlabel("message size")
            ax.set_ylabel(ylabel)
            ax.set_title(_group_label(group), fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(_title(doc), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read benchmark JSON {path}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise InvalidArgument(f"{path} is not a JSON file written by `mpigpu.bench --json` (no 'results' list)")
    return doc


def compare(a_path: Path, b_path: Path) -> list[str]:
    """The table of B/A time ratios for every path and size measured in both runs."""
    a, b = _load(a_path), _load(b_path)

    def index(doc: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
        return {(r["path"], r["placement"], r["dtype"], r["op"], r["inplace"], r["bytes"]): r for r in doc["results"]}

    ia, ib = index(a), index(b)
    common = [k for k in ia if k in ib]
    lines = [f"# A: {a_path}  {_title(a)}", f"# B: {b_path}  {_title(b)}"]
    lines.append(
        f"#{'path':>13} {'place':>5} {'type':>9} {'redop':>5} {'mode':>5} {'size':>12} "
        f"{'A(us)':>11} {'B(us)':>11} {'B/A':>7} {'busbw A':>9} {'busbw B':>9}"
    )
    logs: dict[str, list[float]] = {}
    for key in common:
        ra, rb = ia[key], ib[key]
        ta, tb = ra["median_us"] or ra["time_us"], rb["median_us"] or rb["time_us"]
        ratio = tb / ta if ta else math.inf
        if math.isfinite(ratio) and ratio > 0:
            logs.setdefault(f"{key[0]} ({PLACE_LABEL.get(key[1], key[1])})", []).append(math.log(ratio))
        lines.append(
            f" {key[0]:>13} {PLACE_LABEL.get(key[1], key[1]):>5} {key[2]:>9} {key[3]:>5} "
            f"{'in' if key[4] else 'out':>5} {key[5]:>12} {ta:>11.2f} {tb:>11.2f} {ratio:>7.3f} "
            f"{ra['busbw_gbps']:>9.3f} {rb['busbw_gbps']:>9.3f}"
        )
    for name, values in logs.items():
        lines.append(f"# {name}: B/A geometric mean {math.exp(sum(values) / len(values)):.3f} over {len(values)} sizes")
    only_a, only_b = len(ia) - len(common), len(ib) - len(common)
    lines.append(f"# {len(common)} measurements in both; {only_a} only in A, {only_b} only in B")
    return lines


# -- the command ------------------------------------------------------------------------------
def _header(ctx: Any, args: argparse.Namespace, paths: list[PathSpec], skipped: list[str]) -> list[str]:
    sizes = args.sizes
    iters = f"{args.iters}" if args.iters else f"adaptive (~{TARGET_REP_S * 1e3:g} ms per repetition)"
    modes = " and ".join("in-place" if m else "out-of-place" for m in args.modes)
    lines = header_lines(ctx)
    lines += [
        f"# sizes {size_label(sizes[0])} .. {size_label(sizes[-1])} x{args.step_factor} ({len(sizes)} sizes), "
        f"dtypes {','.join(args.dtypes)}, ops {','.join(args.ops)}, {modes}",
        f"# iterations {iters}, {args.repeats} repetitions, warm-up {args.warmup}, time limit "
        + (f"{args.time_limit:g} s per size" if args.time_limit else "none"),
        "# time: mean per call on the slowest rank; median and spread over repetitions (us); "
        "algbw, busbw in GB/s; #wrong summed over ranks",
        "# paths: " + ", ".join(p.label for p in paths),
    ]
    lines += [f"# skipped: {line}" for line in skipped]
    tune_state = f"applies ({ctx.tuning.source})" if ctx.tuning else "none for this machine; auto uses the rules"
    lines.append(f"# tuning table {ctx.settings.tune_path}: {tune_state}")
    return lines


def run(args: argparse.Namespace, command: list[str]) -> int:
    from mpigpu._mpi import world
    from mpigpu.context import Context

    ctx = Context.get(world())
    rank = ctx.rank
    args.sizes = size_list(args.min_bytes, args.max_bytes, args.step_factor)
    both = args.inplace == args.out_of_place  # neither flag, or both: time both modes
    args.modes = [False, True] if both else [args.inplace]
    try:
        paths, skipped = plan_paths(ctx, args)
        if not paths and not args.tune:
            raise InvalidArgument("nothing to time: " + ("; ".join(skipped) or "no backend selected"))
    except InvalidArgument as exc:
        if rank == 0:
            sys.stderr.write(f"{prog('mpigpu.bench')}: error: {exc}\n")
        return 2
    lines = _header(ctx, args, paths, skipped)
    machine = machine_info(ctx)
    if rank == 0:
        print("\n".join(lines))
        sys.stdout.flush()

    sweep = Sweep(ctx, args)
    placements = list(dict.fromkeys(p.placement for p in paths))
    ops = [Op(o) for o in args.ops]
    tuning = None

    def sweep_all(selected: list[PathSpec]) -> None:
        for placement in placements:
            mine = [p for p in selected if p.placement == placement]
            for dtype in (DTYPES[d] for d in args.dtypes):
                if mine:
                    found = sweep.sweep_group(mine, placement, dtype, ops)
                    if rank == 0:
                        print("\n".join(render_tables(found, sweep.measurements)))
                        sys.stdout.flush()

    try:
        sweep_all(paths)
        if args.tune:
            tuning = _tune(ctx, sweep, args, command)
            if tuning is not None:
                sweep_all([PathSpec("auto", "auto", p) for p in placements])
    finally:
        sweep.close()

    measurements = sweep.measurements
    used = sorted({m.chosen or m.path.name for m in measurements if m.path.kind != "anchor"})
    described = {name: ctx.backend(name).describe() for name in used}  # collective: may create a backend
    checked = [*measurements, *sweep.rechecks]
    failures = [m for m in checked if m.result.wrong > 0]
    auto = _auto_summary(measurements)
    ok = not failures
    if rank == 0:
        tail = ["#"]
        tail += [f"# not timed: {line}" for line in sweep.unsupported]
        tail += [f"# {line}" for line in sweep.stopped]
        if auto:
            w = auto["worst"]
            tail.append(
                f"# auto vs the fastest mpigpu backend (median): within {AUTO_TARGET - 1:.0%} at "
                f"{auto['within_target']}/{auto['sizes']} sizes; worst {auto['worst_ratio']:.3f}x at "
                f"{size_label(w['bytes'])} {w['dtype']} {w['op']} {'in-place' if w['inplace'] else 'out-of-place'} "
                f"({PLACE_LABEL[w['placement']]}: chose {w['chosen']}, fastest {w['fastest']})"
            )
        for m in failures:
            r = m.result
            tail.append(
                f"# FAIL: {m.path.label} {r.dtype} {r.op} {'in-place' if r.inplace else 'out-of-place'} "
                f"{size_label(r.bytes)}: {r.wrong} wrong element{'s' if r.wrong != 1 else ''}"
            )
        wrong = sum(m.result.wrong for m in failures)
        tail.append(
            f"# {'PASS' if ok else 'FAIL'}: {wrong} wrong elements in {len(checked)} checked measurements "
            f"over {ctx.size} rank{'s' if ctx.size != 1 else ''}"
        )
        print("\n".join(tail))
        sys.stdout.flush()
        doc = {
            "format": "mpigpu-bench/1",
            "ok": ok,
            "date": now(),
            "command": command,
            "ranks": ctx.size,
            "nodes": ctx.layout.num_nodes,
            "machine": machine,
            "versions": _versions(ctx),
            "header": lines,
            "settings": _settings(ctx, args),
            "paths": [dataclasses.asdict(p) for p in paths],
            "skipped": skipped,
            "not_timed": sweep.unsupported,
            "stopped": sweep.stopped,
            "backend_settings": described,
            "results": [m.to_dict() for m in measurements],
            "rechecks": [m.to_dict() for m in sweep.rechecks],
            "failures": [m.to_dict() for m in failures],
            "tuning": tuning,
            "auto": auto,
        }
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
        if args.plot is not None:
            plot(doc, args.plot)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    _check_args(parser, args)
    if args.compare is not None:
        with contextlib.suppress(BrokenPipeError):
            try:
                print("\n".join(compare(*args.compare)))
            except InvalidArgument as exc:
                sys.stderr.write(f"{prog('mpigpu.bench')}: error: {exc}\n")
                return 2
        return 0
    if args.replot is not None:
        try:
            plot(_load(args.replot), args.plot)
        except InvalidArgument as exc:
            sys.stderr.write(f"{prog('mpigpu.bench')}: error: {exc}\n")
            return 2
        return 0
    from mpigpu.failsafe import abort_on_exception

    abort_on_exception()  # one rank's failure ends the job, with its message
    command = [os.path.basename(sys.executable) or "python", "-m", "mpigpu.bench", *raw]
    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
