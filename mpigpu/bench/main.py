"""``mpiexec -n N python -m mpigpu.bench``: the allreduce benchmark (``mpigpu.benchmark`` too).

Sweeps message sizes (8 B to 1 GiB by default) over every available mpigpu backend, called as users
call it (``allreduce(x)``, checked every call) and as a persistent request (``req()``), beside the
raw anchors each one has to beat (``mpigpu.bench.anchors``: raw NCCL, torch.distributed, MPI), in place
and out of place, for the chosen dtypes and ops. Every path is verified at every size before it is
timed (nccl-tests' check, with the 'exact' pattern); a single wrong element makes the exit status 1.
Rank 0 prints one fixed-width table per path and group, then the user's call, the request and the
anchors side by side, and can write JSON (--json), a plot (--plot) and a crossover table for
``backend="auto"`` (--tune); ``--compare A.json B.json`` prints the ratios between two runs.

This module is the command (options, header, the run, the JSON document, tuning); the sweep is in
``bench_sweep``, what is called and how it is timed in ``bench_calls``, the tables, summary, plot
and compare in ``bench_report``; ``--collective broadcast|allgather|reduce_scatter|alltoall`` in ``bench_collectives``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from mpigpu.backends import BACKEND_NAMES
from mpigpu.bench.anchors import ANCHORS
from mpigpu.bench.calls import FRAMEWORKS, TIMINGS
from mpigpu.bench.collected import ORDER, gpu_tag, merged_table, plot_collectives, result_name
from mpigpu.bench.collectives import COLLECTIVES, OUT_CALLS, refuse_options
from mpigpu.bench.report import (
    ALLREDUCE_CALLS,
    CALLS,
    PathSpec,
    auto_summary,
    call_description,
    compare,
    failures,
    load_run,
    median_us,
    plot,
    render_tables,
    side_by_side,
    summary_lines,
)
from mpigpu.bench.sweep import MAX_ITERS, TARGET_TURN_S, Interrupted, Sweep, auto_paths, plan_paths
from mpigpu.cli import (
    Parser,
    choice_arg,
    comma_list,
    count_arg,
    dtype_arg,
    header_lines,
    nonneg_int,
    now,
    op_arg,
    positive_int,
    prog,
    refuse,
    seconds_arg,
    versions,
    write_json,
)
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import InvalidArgument, install_hint
from mpigpu.core.ops import Op
from mpigpu.runtime.tuning import size_label

__all__ = ["build_parser", "main", "run", "size_list"]

PATH_NAMES = ("auto", *BACKEND_NAMES, *ANCHORS)
# The default sweep where only host arrays are timed (no GPU): about 2 minutes and under 2 GB on a
# 2-core machine (docs/bench.md), instead of 1 GiB in steps of 2 (over 7 minutes, ~10 GB).
QUICK_MAX_BYTES = 64 << 20
QUICK_STEP = 4
INTERRUPTED_STATUS = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)
# environment variables that change results, recorded in the JSON
_ENV_PREFIXES = ("MPIGPU_", "NCCL_", "I_MPI_", "MPIR_CVAR_", "MPICH_", "OMPI_", "UCX_", "CUDA_VISIBLE_DEVICES")


# -- options ------------------------------------------------------------------------------------
def build_parser() -> Parser:
    parser = Parser(
        prog=prog("mpigpu.bench"),
        description=(
            "Time allreduce over a range of message sizes for every available mpigpu backend, as users call it\n"
            "(allreduce(x)) and as a persistent request (req()), beside the raw anchors (nccl-raw, torch-nccl,\n"
            "seed-staging, mpi-device, mpi-host, torch-gloo). Every path is verified at every size before it is\n"
            "timed. --collective broadcast|allgather|reduce_scatter|alltoall times mpigpu.broadcast(x, root=0),\n"
            "mpigpu.allgather(x), mpigpu.reduce_scatter(x, 'sum') or mpigpu.alltoall(x, splits) instead, beside\n"
            "raw NCCL, torch.distributed and MPI. Run it under your launcher:\n"
            "  mpiexec -n 4 python -m mpigpu.bench --max-bytes 64M --json run.json --plot run.png\n"
            "  mpiexec -n 4 python -m mpigpu.bench --collective allgather --sizes 8,64K,1M"
        ),
        epilog="At each size the paths are timed interleaved: --rounds rounds, each path's turn a warm-up and\n"
        "--iters calls, round r starting at path r mod k. time = mean per call on the slowest rank; median =\n"
        "the median over rounds of each round's time per call on the slowest rank (the figure compared);\n"
        "spread = max - min of the rounds'; all wall clock, the same harness for every row (--timing).\n"
        "busbw as nccl-tests: allreduce algbw = bytes/time, busbw = algbw * 2(n-1)/n;\n"
        "broadcast busbw = algbw = bytes/time; allgather algbw = OUTPUT bytes (n x the per-rank input)/time,\n"
        "busbw = algbw * (n-1)/n; reduce_scatter and alltoall algbw = input bytes/time, busbw = algbw * (n-1)/n.\n"
        "Sizes are per rank (allgather: each rank's input). exit status: 0 if\n"
        "every element was right, 1 if any was wrong, 2 for invalid options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sizes = parser.add_argument_group("sizes")
    sizes.add_argument("--min-bytes", "-b", type=count_arg, default=8, metavar="SIZE", help="smallest (default 8)")
    sizes.add_argument(
        "--max-bytes", "-e", type=count_arg, default=None, metavar="SIZE",
        help=f"largest (default 1G with GPUs; {size_label(QUICK_MAX_BYTES)} where only host arrays are timed)",
    )  # fmt: skip
    sizes.add_argument(
        "--step-factor", "-f", type=positive_int, default=None, metavar="F",
        help=f"size step (default 2; {QUICK_STEP} where only host arrays are timed and --max-bytes is not given)",
    )  # fmt: skip
    sizes.add_argument(
        "--sizes", type=comma_list(count_arg, "sizes"), default=None, metavar="LIST",
        help="comma-separated sizes to time instead of -b/-e/-f (8,64K,1M,...)",
    )  # fmt: skip
    what = parser.add_argument_group("what to time")
    what.add_argument(
        "--collective", type=comma_list(choice_arg(COLLECTIVES, "collective"), "collectives", ORDER),
        default=["allreduce"], metavar="LIST",
        help="comma-separated collectives or 'all', each swept in turn in one job (one stream, one set of anchors): "
        "allreduce (default); reduce_scatter = mpigpu.reduce_scatter(x, 'sum', out=o); alltoall = mpigpu.alltoall(x); "
        "broadcast = mpigpu.broadcast(x, root=0), in place; allgather = mpigpu.allgather(x); sizes = each rank's "
        "input. The four: the user call only (and 'out', with out=o, where mpigpu.allgather/alltoall take it), "
        "no --ops, no --tune; broadcast refuses --out-of-place, the others --inplace. With several, --calls, "
        "--inplace and --out-of-place apply to allreduce, and --json-dir names the files",
    )  # fmt: skip
    what.add_argument(
        "--dtypes", type=comma_list(dtype_arg, "dtypes", DTYPES), default=["float32"], metavar="LIST",
        help=f"comma-separated element types or 'all' (default float32): {', '.join(DTYPES)}",
    )  # fmt: skip
    what.add_argument(
        "--ops", type=comma_list(op_arg, "ops", [o.value for o in Op]), default=["sum"], metavar="LIST",
        help="comma-separated reductions or 'all' (default sum, as nccl-tests)",
    )  # fmt: skip
    what.add_argument(
        "--backends", type=comma_list(choice_arg(PATH_NAMES, "backend or anchor"), "backends"), default=None,
        metavar="LIST",
        help="comma-separated backends, anchors and/or auto (default: every available backend and anchor); "
        "a backend always brings its anchor",
    )  # fmt: skip
    what.add_argument(
        "--calls", type=comma_list(choice_arg(CALLS, "call"), "calls", ALLREDUCE_CALLS), default=None,
        metavar="LIST",
        help="how each mpigpu backend and auto is called, comma-separated or 'all' (default user,persistent; "
        "user for the other collectives, and out for allgather and alltoall: into an output made once): "
        "user = mpigpu.allreduce(x) checked every call; persistent = req() of a request from allreduce_init; "
        "prepared = mpigpu.calls.reduce.run of a call prepared once (diagnostic; --tune adds it)",
    )  # fmt: skip
    what.add_argument(
        "--framework", choices=FRAMEWORKS, default="native",
        help="the arrays given to allreduce and allreduce_init: native = CuPy on GPUs, NumPy on the host "
        "(default); torch = torch tensors over the same memory",
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
        help=f"timed calls per path and round (default: adaptive, about {TARGET_TURN_S * 1e3:g} ms per path and "
        f"round, 1 to {MAX_ITERS})",
    )  # fmt: skip
    timing.add_argument(
        "--timing", choices=TIMINGS, default="call",
        help="call (default): every sample is one call between a barrier and a stream synchronisation, median "
        "per call; loop: every sample is --iters calls back to back, then one synchronisation",
    )  # fmt: skip
    timing.add_argument(
        "--warmup", "-w", type=nonneg_int, default=5, metavar="N", help="untimed calls per path and round (default 5)"
    )
    timing.add_argument(
        "--rounds", "--repeats", type=positive_int, default=5, metavar="R",
        help="rounds (default 5): at each size every path is timed in turn, round r starting at path r mod k; "
        "a path's figure is the median over rounds (--repeats: the older name)",
    )  # fmt: skip
    timing.add_argument(
        "--time-limit", type=seconds_arg, default=60.0, metavar="S",
        help="stop the sweep before a size whose paths (checks and rounds) would take longer than S seconds "
        "(default 60; 0 = none)",
    )  # fmt: skip
    output = parser.add_argument_group("output")
    output.add_argument("--json", type=Path, metavar="PATH", help="write every figure and the machine as JSON")
    output.add_argument(
        "--json-dir", type=Path, metavar="DIR",
        help="write a JSON document per collective, DIR/<gpu>x<n>-<collective>-<date>.json (machine, versions and "
        "date inside), and the table of them all, DIR/<gpu>x<n>-collectives-<date>.md",
    )  # fmt: skip
    output.add_argument(
        "--tag", metavar="TAG", help="the <gpu>x<n> of --json-dir's names (default: the GPU model and count, "
        "h100x2; cpux<ranks> without GPUs)",
    )  # fmt: skip
    output.add_argument(
        "--merge", nargs="+", type=Path, metavar="JSON",
        help="print the table of the collectives' JSON runs given (markdown; the goals read off it) and exit",
    )  # fmt: skip
    output.add_argument("--plot", type=Path, metavar="PNG", help="plot busbw and time against size (matplotlib)")
    output.add_argument(
        "--tune", "--autotune", action="store_true",
        help="write the fastest backend per size band into the tuning table (MPIGPU_TUNE_FILE), then time auto; "
        "backends are compared by their prepared calls",
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
    if args.sizes is not None and any(size < 1 for size in args.sizes):
        parser.error("--sizes: every size must be at least 1 byte")
    if args.max_bytes is not None and args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.step_factor is not None and args.step_factor < 2:
        parser.error("--step-factor must be >= 2")
    if args.replot is not None and args.plot is None:
        parser.error("--replot needs --plot PATH.png")
    if len(args.collective) > 1 and args.json is not None:
        parser.error("--json names one file: with several collectives use --json-dir DIR (a file per collective)")
    if len(args.collective) > 1 and args.tune:
        parser.error("--tune measures allreduce's crossover table: run it with --collective allreduce alone")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot needs matplotlib: {install_hint('plot', 'matplotlib')}")


def size_list(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min_bytes, min_bytes*factor, ... below max_bytes, and max_bytes itself: the largest size
    asked for is always timed, a power of ``factor`` from ``min_bytes`` or not."""
    sizes, size = [], min_bytes
    while size < max_bytes:
        sizes.append(size)
        size *= factor
    return [*sizes, max_bytes]


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
    from mpigpu.runtime.tuning import machine_signature

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
    from mpigpu.core._cuda import cuda_version

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
        "collective": args.collective,
        "sizes": args.sizes,
        "calls": args.calls,
        "timing": args.timing,
        "framework": args.framework,
        "min_bytes": args.min_bytes,
        "max_bytes": args.max_bytes,
        "step_factor": args.step_factor,
        "dtypes": args.dtypes,
        "ops": args.ops,
        "backends": args.backends,
        "placement": args.placement,
        "modes": ["in-place" if m else "out-of-place" for m in args.modes],
        "iters": args.iters
        if args.iters
        else f"adaptive ({TARGET_TURN_S * 1e3:g} ms per path and round, <= {MAX_ITERS})",
        "warmup": args.warmup,
        "repeats": args.rounds,
        "rounds": args.rounds,
        "order": "interleaved: at each size every path in turn, round r starting at path r mod k",
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
    from mpigpu.runtime.tuning import (
        Sample,
        bands_from_samples,
        describe_bands,
        install,
        machine_signature,
        signature_key,
    )

    samples = [
        Sample(m.path.placement, m.result.bytes, m.path.name, median_us(m) or 0.0,
               (m.result.dtype, m.result.op, m.result.inplace), ok=m.result.wrong == 0)
        for m in sweep.measurements
        if m.path.kind == "backend" and m.path.call == "prepared"  # the backend's own cost, as always
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


# -- the command ------------------------------------------------------------------------------
def _header(ctx: Any, args: argparse.Namespace, paths: list[PathSpec], skipped: list[str]) -> list[str]:
    sizes = args.sizes
    iters = f"{args.iters}" if args.iters else f"adaptive (~{TARGET_TURN_S * 1e3:g} ms per path and round)"
    modes = " and ".join("in-place" if m else "out-of-place" for m in args.modes)
    lines = header_lines(ctx)
    steps = f"x{args.step_factor}" if args.given_sizes is None else "as listed"
    timing = {
        "call": "per call: barrier, clock, one call, stream synchronize, clock",
        "loop": "per round: barrier, clock, the calls back to back, stream synchronize, clock",
    }[args.timing]
    lines += [
        f"# sizes {size_label(sizes[0])} .. {size_label(sizes[-1])} {steps} ({len(sizes)} sizes), "
        f"dtypes {','.join(args.dtypes)}, ops {','.join(args.ops)}, {modes}",
        f"# columns interleaved: at each size the paths (in the order of '# paths') are timed in turn, "
        f"{args.rounds} rounds, round r starting at path r mod k; each turn: warm-up, stream synchronize, "
        "the timed calls",
        f"# iterations {iters}, {args.rounds} rounds, warm-up {args.warmup} per path and round, time limit "
        + (f"{args.time_limit:g} s per size (all its paths)" if args.time_limit else "none"),
        f"# timing {args.timing}: wall clock {timing}; the same for every row",
        "# time: mean per call (us), slowest rank; median: the median over rounds of each round's time per call "
        "on the slowest rank; spread: max - min of the rounds' (us); algbw, busbw in GB/s; #wrong summed over ranks",
    ]
    lines += args.collective_lines
    lines += [f"# call {c}: {call_description(c, args.collective)}" for c in args.calls]
    arrays = "torch tensors" if args.framework == "torch" else "CuPy arrays on GPUs, NumPy arrays on the host"
    called = "allreduce and allreduce_init" if args.collective == "allreduce" else args.collective
    lines += [
        f"# arrays passed to {called}: {arrays}; the default stream is the benchmark's",
        "# paths: " + ", ".join(p.label for p in paths),
    ]
    lines += [f"# skipped: {line}" for line in skipped]
    tune_state = f"applies ({ctx.tuning.source})" if ctx.tuning else "none for this machine; auto uses the rules"
    lines.append(f"# tuning table {ctx.settings.tune_path}: {tune_state}")
    return lines


def _part(ctx: Any, args: argparse.Namespace, collective: str, several: bool) -> argparse.Namespace:
    """The options of one collective's sweep, with its paths and skipped lines (collective: a
    refusal raises the same InvalidArgument on every rank). With several collectives, --calls,
    --inplace and --out-of-place are allreduce's; the others take their own mode and calls."""
    part = argparse.Namespace(**vars(args))
    part.collective = collective
    part.collective_lines = []
    both = args.inplace == args.out_of_place  # neither flag, or both: time both modes
    part.modes = [False, True] if both else [args.inplace]
    if collective != "allreduce":
        if several:
            takes = ("user", "out") if collective in OUT_CALLS else ("user",)
            part.calls = [c for c in args.calls or [] if c in takes] or None
            part.inplace = part.out_of_place = False
        part.collective_lines = refuse_options(part)  # sets calls and modes
    else:
        calls = [c for c in args.calls or [] if c in ALLREDUCE_CALLS or not several]
        if "out" in calls:
            raise InvalidArgument("--calls out is allgather's and alltoall's: allreduce's out= is --out-of-place")
        part.calls = calls or ["user", "persistent"]
        if args.tune and "prepared" not in part.calls:
            part.calls = [*part.calls, "prepared"]  # tuning compares the backends' prepared calls
    part.paths, part.skipped = plan_paths(ctx, part)
    if not part.paths and not args.tune:
        where = f" for {collective}" if several else ""
        raise InvalidArgument(f"nothing to time{where}: " + ("; ".join(part.skipped) or "no backend selected"))
    return part


def _sweep_all(sweep: Sweep, part: argparse.Namespace, selected: list[PathSpec]) -> None:
    """Every placement and dtype of ``selected`` (collective); rank 0 prints each group's tables."""
    ops = [Op(o) for o in part.ops]
    for placement in dict.fromkeys(p.placement for p in part.paths):
        mine = [p for p in selected if p.placement == placement]
        for dtype in (DTYPES[d] for d in part.dtypes):
            if mine:
                found = sweep.sweep_group(mine, placement, dtype, ops)
                if sweep.rank == 0:
                    print("\n".join(render_tables(found, sweep.measurements)))
                    sys.stdout.flush()


def _document(
    ctx: Any, sweep: Sweep, part: argparse.Namespace, run_info: dict[str, Any], tuning: Any, interrupted: bool
) -> dict[str, Any] | None:
    """Print the side-by-side table and the summary of one collective's sweep, and return its JSON
    document (rank 0; None elsewhere). Collective: describing the backends used may create one."""
    measurements = sweep.measurements
    used = sorted({m.chosen or m.path.name for m in measurements if m.path.kind != "anchor"})
    described = {name: ctx.backend(name).describe() for name in used}
    checked = [*measurements, *sweep.rechecks]
    failed = failures(checked)
    auto = auto_summary(measurements)
    if ctx.rank != 0:
        return None
    if interrupted:
        print(f"#\n# INTERRUPTED (Ctrl-C) after {len(measurements)} measurements: the results so far")
    print("\n".join(side_by_side(measurements, part.timing)))
    print("\n".join(summary_lines(checked, auto, sweep.unsupported, sweep.stopped, ctx.size)))
    sys.stdout.flush()
    return {
        "format": "mpigpu-bench/1",
        "collective": part.collective,
        "ok": not failed,
        "interrupted": interrupted,
        "date": now(),
        "command": run_info["command"],
        "run": {k: v for k, v in run_info.items() if k != "command"},
        "ranks": ctx.size,
        "nodes": ctx.layout.num_nodes,
        "machine": run_info["machine"],
        "versions": run_info["versions"],
        "header": part.header,
        "settings": _settings(ctx, part),
        "paths": [dataclasses.asdict(p) for p in part.paths],
        "skipped": part.skipped,
        "not_timed": sweep.unsupported,
        "stopped": sweep.stopped,
        "backend_settings": described,
        "results": [m.to_dict() for m in measurements],
        "rechecks": [m.to_dict() for m in sweep.rechecks],
        "failures": [m.to_dict() for m in failed],
        "tuning": tuning,
        "auto": auto,
    }


def run(args: argparse.Namespace, command: list[str]) -> int:
    from mpigpu.core._mpi import world
    from mpigpu.runtime.context import Context

    ctx = Context.get(world())
    rank = ctx.rank
    args.given_sizes = args.sizes
    host_only = args.placement == "host" or (args.placement == "auto" and not ctx.all_have_gpus)
    if args.step_factor is None:  # the quick steps only where the largest size is the quick default too
        args.step_factor = QUICK_STEP if host_only and args.max_bytes is None else 2
    if args.max_bytes is None:
        args.max_bytes = max(args.min_bytes, QUICK_MAX_BYTES if host_only else 1 << 30)
    if args.sizes is None:
        args.sizes = size_list(args.min_bytes, args.max_bytes, args.step_factor)
    else:
        args.sizes = sorted(set(args.sizes))
        args.min_bytes, args.max_bytes = args.sizes[0], args.sizes[-1]
    several = len(args.collective) > 1
    try:
        parts = [_part(ctx, args, collective, several) for collective in args.collective]
    except InvalidArgument as exc:
        return refuse("mpigpu.bench", exc, rank)
    started = now()
    machine = machine_info(ctx)
    run_info = {
        "command": command, "collectives": args.collective, "started": started, "machine": machine,
        "versions": _versions(ctx), "tag": args.tag or gpu_tag(machine, ctx.size),
    }  # fmt: skip
    sweep = Sweep(ctx, parts[0])
    docs: list[dict[str, Any]] = []
    interrupted = False
    try:
        with sweep.stop_on_sigint():
            for part in parts:  # one collective after another, each one's paths interleaved at each size
                sweep.use(part)
                part.header = _header(ctx, part, part.paths, part.skipped)
                if rank == 0:
                    print("\n".join(part.header))
                    sys.stdout.flush()
                tuning = None
                try:
                    _sweep_all(sweep, part, part.paths)
                    if part.tune:
                        tuning = _tune(ctx, sweep, part, command)
                        if tuning is not None:
                            placements = dict.fromkeys(p.placement for p in part.paths)
                            _sweep_all(sweep, part, [p for pl in placements for p in auto_paths(pl, part.calls)])
                except Interrupted:
                    interrupted = True
                doc = _document(ctx, sweep, part, run_info, tuning, interrupted)
                if doc is not None:
                    docs.append(doc)
                if interrupted:
                    break
    finally:
        sweep.close()
    ok = ctx.comm.allreduce(int(all(d["ok"] for d in docs)), op=_mpi_min()) == 1  # rank 0 holds the docs
    if rank == 0:
        _write(args, docs, run_info)
    return 1 if not ok else (INTERRUPTED_STATUS if interrupted else 0)


def _mpi_min() -> Any:
    from mpigpu.core._mpi import MPI

    return MPI().MIN


def _write(args: argparse.Namespace, docs: list[dict[str, Any]], run_info: dict[str, Any]) -> None:
    """Rank 0: --json (one collective), --json-dir (a file per collective and the table of them all),
    --plot (one collective's plot, or a panel per collective); the table printed where there are several."""
    several = len(args.collective) > 1
    table = merged_table(docs) if docs else []
    if several and table:
        print("#\n# every collective of this run\n#")
        print("\n".join(table))
        sys.stdout.flush()
    if args.json is not None and docs:
        write_json(args.json, docs[0])
    if args.json_dir is not None:
        tag, day = run_info["tag"], run_info["started"]
        for doc in docs:
            write_json(args.json_dir / result_name(tag, doc["collective"], day), doc)
        if table:
            (args.json_dir / result_name(tag, "collectives", day, "md")).write_text("\n".join(table) + "\n")
    if args.plot is not None and docs:
        if several:
            plot_collectives(docs, args.plot)
        else:
            plot(docs[0], args.plot)


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
                return refuse("mpigpu.bench", exc)
        return 0
    if args.replot is not None:
        try:
            plot(load_run(args.replot), args.plot)
        except InvalidArgument as exc:
            return refuse("mpigpu.bench", exc)
        return 0
    if args.merge is not None:
        try:
            docs = [load_run(path) for path in args.merge]
        except InvalidArgument as exc:
            return refuse("mpigpu.bench", exc)
        with contextlib.suppress(BrokenPipeError):
            print("\n".join(merged_table(docs)))
        if args.plot is not None:
            plot_collectives(docs, args.plot)
        return 0
    from mpigpu.job.failsafe import abort_on_exception

    abort_on_exception()  # one rank's failure ends the job, with its message
    command = [os.path.basename(sys.executable) or "python", "-m", "mpigpu.bench", *raw]
    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
