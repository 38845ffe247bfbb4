"""``python -m mpigpu.timeline``: merge the ranks' timeline files (MPIGPU_TIMELINE) into one
Chrome/Perfetto trace with a report of who waited for whom, or draw one training step as a PNG.

    MPIGPU_TIMELINE=tl mpiexec -n 2 python train.py          # every rank writes tl/rank<r>.json
    python -m mpigpu.timeline merge tl -o trace.json          # open trace.json in ui.perfetto.dev
    python -m mpigpu.timeline plot tl -o step.png --step 5
    python -m mpigpu.timeline check tl                        # exit 1, naming what is missing

No MPI: it reads files (run it anywhere, after the job).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpigpu.cli import Parser, nonneg_int, prog
from mpigpu.core.errors import install_hint
from mpigpu.core.privatefs import write_file
from mpigpu.timeline.check import problems
from mpigpu.timeline.report import analyse, format_report
from mpigpu.timeline.traces import Rank, TraceError, chrome_trace, load, load_any

__all__ = ["main"]

_EPILOG = """\
What each rank records (docs/training.md#timeline):
  calls     each allreduce: its start, the end of the cross-rank check, the end of its launch, and
            for GPU arrays its completion on the stream ("calls (GPU completion)" lane); each start of
            a persistent request (allreduce_init) likewise
  buckets   each Averager / BackwardAverager bucket: ready (its last gradient arrived), launch
            (packing starts), launched (its allreduce started), done (the reduction finished)
  backward  BackwardAverager: the first gradient hook to the last (and the GPU's end of backward)
  step      finish() and the optimizer's step
The report matches each collective across ranks by its order (a call: its communicator and number;
a bucket: its Averager, step and index), names the rank that arrived last and how long the others
waited for it, and how much of the buckets' reduction time lay inside the backward pass.
"""


def _parser() -> Parser:
    parser = Parser(
        prog=prog("mpigpu.timeline"),
        description="Merge and draw mpigpu timelines (MPIGPU_TIMELINE=<directory>: one file per rank).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{merge,plot,check}")
    merge = sub.add_parser(
        "merge",
        help="merge the ranks into one Chrome/Perfetto trace and print who waited for whom",
        description="Merge <directory>/rank<r>.json into one Chrome/Perfetto trace (pid = rank, tid = lane) "
        "and print the report: per rank how often it arrived last and how long the others waited for it, "
        "the collectives waited for longest, and the communication hidden behind backward.",
    )
    merge.add_argument("directory", type=Path, help="the MPIGPU_TIMELINE directory of the job")
    merge.add_argument("-o", "--output", type=Path, help="the trace to write (default: <directory>/trace.json)")
    merge.add_argument("--top", type=nonneg_int, default=10, help="collectives listed by wait (0: all; default 10)")
    plot = sub.add_parser(
        "plot",
        help="draw one training step as a PNG (lanes per rank)",
        description="Draw one step (default: the last every rank recorded; the whole trace without training "
        "steps) from a timeline directory or a trace written by merge. Needs matplotlib (the plot extra).",
    )
    plot.add_argument("source", type=Path, help="a timeline directory or a trace.json written by merge")
    plot.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    plot.add_argument("--step", type=nonneg_int, help="the step to draw (default: the last one recorded)")
    plot.add_argument("--title", default="", help="the figure's title")
    check = sub.add_parser(
        "check",
        help="check that every rank's file is there and every bucket's events are complete",
        description="Exit 1, printing one line per gap, if a rank's file is missing, a rank dropped events, a "
        "bucket lacks one of its marks (ready, launch, launched, done) or has them out of order, a rank lacks a "
        "bucket others recorded, or a step has no backward span (BackwardAverager) or a bucket ready outside it.",
    )
    check.add_argument("source", type=Path, help="a timeline directory or a trace.json written by merge")
    check.add_argument("--no-backward", action="store_true",
                       help="do not require backward spans (the Averager after backward records none)")  # fmt: skip
    return parser


def _check(ranks: list[Rank], backward: bool) -> int:
    gaps = problems(ranks, backward=backward)
    for line in gaps:
        print(f"missing: {line}")
    if gaps:
        return 1
    buckets = [e for e in ranks[0].events if e["kind"] == "bucket"]
    steps = sorted({e["step"] for e in buckets})
    print(f"# complete: {len(ranks)} ranks, {len(steps)} steps, {len(buckets) // max(len(steps), 1)} buckets per step")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "merge":
            ranks = load(args.directory)
            output = args.output or args.directory / "trace.json"
            write_file(output, json.dumps(chrome_trace(ranks), separators=(",", ":")).encode(), 0o644)
            print(f"# wrote {output} (open it in ui.perfetto.dev or chrome://tracing)")
            print(format_report(analyse(ranks), args.top))
            return 0
        if args.command == "check":
            return _check(load_any(args.source), not args.no_backward)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            hint = install_hint("plot", "matplotlib")
            sys.stderr.write(f"{prog('mpigpu.timeline')}: error: plot needs matplotlib: {hint}\n")
            return 2
        from mpigpu.timeline.plot import plot_step

        step = plot_step(load_any(args.source), args.output, args.step, args.title)
        print(f"# wrote {args.output}" + ("" if step is None else f" (step {step})"))
        return 0
    except TraceError as exc:
        sys.stderr.write(f"{prog('mpigpu.timeline')}: error: {exc}\n")
        return 2
