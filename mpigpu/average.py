"""``mpiexec -n N python -m mpigpu.average``: every rank computes a local gradient, the ranks average
it, every element is verified against the closed form, and the call is timed.

This is the seed sample (grad[i] = rank + 0.001*i, averaged to (N-1)/2 + 0.001*i) made into a
tool. Exit code 0 only if no element is wrong on any rank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mpigpu.cli import (
    DTYPE_HELP,
    Parser,
    backend_arg,
    count_arg,
    dtype_arg,
    header_lines,
    nonneg_int,
    now,
    parse_command,
    positive_int,
    prog,
    refuse,
    versions,
    write_json,
)
from mpigpu.core.config import ENV_VARS
from mpigpu.core.ops import Op

__all__ = ["main"]

ROW_HEADER = (
    f"#{'bytes':>12} {'elements':>11} {'type':>9} {'op':>5} {'backend':>11} {'place':>6} "
    f"{'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}"
)


def format_row(result: Any) -> str:
    wrong = "N/A" if result.wrong < 0 else str(result.wrong)
    place = "in" if result.inplace else "out"
    return (
        f" {result.bytes:>12} {result.elements:>11} {result.dtype:>9} {result.op:>5} {result.backend:>11} "
        f"{place:>6} {result.time_us:>10.2f} {result.algbw_gbps:>12.3f} {result.busbw_gbps:>12.3f} {wrong:>7}"
    )


def build_parser() -> Parser:
    env = "\n".join(f"  {name:<24} {text}" for name, text in ENV_VARS.items())
    parser = Parser(
        prog=prog("mpigpu.average"),
        description=(
            "Average a gradient across MPI ranks, verify every element and time the call.\n"
            "Each rank fills grad[i] = rank + 0.001*i (pattern 'seed'; on the GPU with an NVRTC kernel),\n"
            "the ranks reduce it, and the result is checked against (N-1)/2 + 0.001*i.\n"
            "Run it under your MPI launcher:  mpiexec -n 4 python -m mpigpu.average --size 1M"
        ),
        epilog=f"environment variables:\n{env}\n\nexit status: 0 if every element on every rank is right, "
        "1 if any is wrong, 2 for invalid options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size",
        type=count_arg,
        default=count_arg("1M"),
        help="elements per rank; K, M, G suffixes are binary (default 1M = 1048576)",
    )
    parser.add_argument("--dtype", type=dtype_arg, default="float32", help=f"{DTYPE_HELP} (default float32)")
    parser.add_argument("--op", choices=[o.value for o in Op], default="avg", help="reduction (default avg)")
    parser.add_argument(
        "--backend",
        type=backend_arg,
        default="auto",
        help="auto (default), ipc, nccl, cuda-aware, host or cpu",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="where the gradient lives: auto = the GPU when every rank has one (default)",
    )
    parser.add_argument(
        "--pattern",
        choices=["seed", "exact"],
        default=None,
        help="seed: rank + 0.001*i (default for floats); exact: small integers whose "
        "sums are exact in any order (default for integer types)",
    )
    parser.add_argument(
        "--out-of-place",
        action="store_true",
        help="reduce into a separate, poisoned output instead of in place",
    )
    parser.add_argument("--iters", type=positive_int, default=20, help="timed calls (default 20)")
    parser.add_argument("--warmup", type=nonneg_int, default=5, help="untimed calls first (default 5)")
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="verify every element (default on)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the result row and PASS/FAIL")
    parser.add_argument(
        "--corrupt", type=nonneg_int, default=0, metavar="N", help=argparse.SUPPRESS
    )  # testing aid: damage N results on rank 0 before checking
    return parser


def _on_gpu(args: argparse.Namespace, ctx: Any) -> bool:
    """True for GPU buffers: the GPU when every rank has one, unless --backend cpu (host arrays only)."""
    from mpigpu.bench.harness import placements
    from mpigpu.core.errors import InvalidArgument

    on_gpu = placements(ctx, args.device, auto_both=False) == [True]
    if on_gpu and args.backend == "cpu":
        if args.device == "gpu":
            raise InvalidArgument("--backend cpu reduces host arrays; use --device cpu or another backend")
        return False
    return on_gpu


def _memory_problem(ctx: Any, per_rank: int, on_gpu: bool) -> str | None:
    """Why the buffers of ``per_rank`` bytes cannot fit (the same text on every rank), or None (collective).

    Host memory is the node's, shared by its ranks; GPU memory is each rank's GPU. Ranks on other
    nodes may see other numbers: the first problem found, in rank order, is everyone's answer."""
    from mpigpu.core.config import size_label
    from mpigpu.job.memory import gpu_free_bytes, host_available_bytes

    mine = None
    if on_gpu:
        free = gpu_free_bytes(ctx.gpu.index)
        if free is not None and per_rank > free:
            mine = (
                f"--size needs {size_label(per_rank)} on each rank's GPU, but GPU {ctx.gpu.index} of rank {ctx.rank} "
                f"has {size_label(free)} free: give a smaller --size"
            )
    else:
        local = ctx.layout.local_size
        available = host_available_bytes()
        if available is not None and per_rank * local > available:
            mine = (
                f"--size needs {size_label(per_rank)} of host memory per rank, {size_label(per_rank * local)} for "
                f"the {local} rank{'s' if local != 1 else ''} on {ctx.layout.hostnames[ctx.rank]}, but it has "
                f"{size_label(available)} available: give a smaller --size"
            )
    problems = ctx.comm.allgather(mine)
    return next((p for p in problems if p is not None), None)


def run(args: argparse.Namespace) -> int:
    from mpigpu.api import prepare
    from mpigpu.api import run as run_prepared
    from mpigpu.bench.harness import command_stream
    from mpigpu.bench.workload import Workload
    from mpigpu.core._mpi import world
    from mpigpu.core.dtypes import parse_dtype
    from mpigpu.core.errors import MpigpuError
    from mpigpu.core.ops import parse_op
    from mpigpu.core.patterns import check_pattern, default_pattern
    from mpigpu.core.timing import Result, max_over_ranks, max_phases_over_ranks, summarize, time_calls
    from mpigpu.core.verify import total_wrong
    from mpigpu.kernels.compile import compile_stats
    from mpigpu.runtime.context import Context
    from mpigpu.runtime.plan import choose

    comm = world()
    ctx = Context.get(comm)
    rank, nranks = ctx.rank, ctx.size
    dtype, op = parse_dtype(args.dtype), parse_op(args.op)
    pattern = args.pattern or default_pattern(dtype)
    # Refusals every rank reaches alike (options; GPUs and backend availability are agreed at
    # start-up): one line and exit status 2, with no collective left waiting.
    try:
        check_pattern(pattern, dtype)
        on_gpu = _on_gpu(args, ctx)
    except MpigpuError as exc:
        return refuse("mpigpu.average", exc, rank)
    problem = _memory_problem(ctx, args.size * dtype.itemsize * (2 if args.out_of_place else 1), on_gpu)
    if problem is not None:
        return refuse("mpigpu.average", problem, rank)
    streams = command_stream(ctx) if on_gpu else (None, None)  # the CuPy stream lives as long as its ref
    stream = streams[1]
    work = Workload.allocate(
        count=args.size, dtype=dtype, op=op, pattern=pattern, rank=rank, nranks=nranks,
        device=ctx.gpu if on_gpu else None, inplace=not args.out_of_place, stream=stream,
    )  # fmt: skip
    try:
        choose(ctx, work.x, op, args.backend)
    except MpigpuError as exc:
        work.free()
        return refuse("mpigpu.average", exc, rank)
    lines = header_lines(ctx)

    def call() -> Any:
        return prepare(work.x, op, out=work.out, comm=comm, backend=args.backend, stream=stream)

    prepared = call()
    choice = prepared.choice
    if rank == 0 and not args.quiet:
        print("\n".join(lines))
        print(f"# backend: {args.backend} -> {choice.backend} ({choice.reason})")
        print(
            f"# {args.size} {dtype.name} elements per rank, op {op.value}, pattern {pattern}, "
            f"{'GPU' if on_gpu else 'host'} memory, {'in place' if work.inplace else 'out of place'}"
        )
        if nranks == 1:
            print("# 1 rank: there is nothing to average across; the result is the input, still verified")
        sys.stdout.flush()

    wrong = -1
    if args.check:
        work.fill()
        work.poison()
        run_prepared(call())
        if rank == 0:
            work.corrupt(args.corrupt)
        wrong = total_wrong(comm, work.wrong())

    work.fill()
    for _ in range(args.warmup):
        run_prepared(call())
    means = time_calls(lambda: run_prepared(call()), args.iters, barrier=comm.Barrier, stream=stream)
    mean, median, spread = summarize(means)
    time_us, per_rank = max_over_ranks(comm, mean)
    backend = ctx.backend(choice.backend)
    phases = max_phases_over_ranks(comm, backend.last_phases)
    kernel_us, _ = max_over_ranks(comm, work.kernel_ms * 1e3)
    result = Result(
        bytes=args.size * dtype.itemsize, elements=args.size, dtype=dtype.name, op=op.value,
        backend=choice.backend, ranks=nranks, time_us=time_us, wrong=wrong, inplace=work.inplace,
        median_us=max_over_ranks(comm, median)[0], spread_us=max_over_ranks(comm, spread)[0],
        phases_us=phases, per_rank_us=per_rank,
    )  # fmt: skip
    ok = wrong <= 0
    if rank == 0:
        if not args.quiet:
            print(ROW_HEADER)
        print(format_row(result))
        if phases and not args.quiet:
            print("# phases (us, max over ranks): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
        if on_gpu and not args.quiet:
            print(f"# gradient kernel: {kernel_us:.1f} us")
        over = f"over {nranks} rank{'s' if nranks != 1 else ''}"
        if wrong < 0:
            print(f"# NOT VERIFIED (--no-check): the results were not compared with the expected values {over}")
        else:
            print(f"# {'PASS' if ok else 'FAIL'}: {wrong} wrong element{'s' if wrong != 1 else ''} {over}")
        sys.stdout.flush()
    if args.json is not None and rank == 0:
        document = {
            "ok": ok,
            "verified": wrong >= 0,
            "ranks": nranks,
            "backend": choice.backend,
            "backend_requested": args.backend,
            "backend_reason": choice.reason,
            "mpi_library": ctx.mpi_lib.name,
            "mpi_version": ctx.mpi_lib.version,
            "cuda_aware": {"aware": ctx.cuda_aware.aware, "rule": ctx.cuda_aware.rule},
            "nccl": ctx.nccl.version if ctx.nccl.available else None,
            "nodes": ctx.layout.num_nodes,
            "header": lines,
            "placement": "gpu" if on_gpu else "host",
            "pattern": pattern,
            "kernel_us": kernel_us if on_gpu else None,
            "compile": [vars(s) for s in compile_stats()],
            "backend_settings": backend.describe(),
            "versions": versions(),
            "date": now(),
            "results": [result.to_dict()],
        }
        write_json(args.json, document)
    work.free()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_command(build_parser(), argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
