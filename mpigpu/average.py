"""``mpiexec -n N python -m mpigpu.average``: every rank computes a local gradient, the ranks average
it, every element is verified against the closed form, and the call is timed.

This is the seed sample (grad[i] = rank + 0.001*i, averaged to (N-1)/2 + 0.001*i) made into a
tool. Exit code 0 only if no element is wrong on any rank.

``--devices-per-rank N`` drives N devices from every process (mpigpu.multi; it sets
MPIGPU_DEVICES_PER_RANK before mpigpu starts): one thread per device, bound with
``mpigpu.on_device``, computes the gradient of participant (rank, device) as the one-device run
computes a rank's, and the average and the check cover every participant. Without GPUs the devices
are host devices (NumPy arrays).
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
            "Run it under your MPI launcher:  mpiexec -n 4 python -m mpigpu.average --size 1M\n"
            "With --devices-per-rank N every process drives N devices, one thread each (mpigpu.on_device):\n"
            "participant p = (rank, device) fills p + 0.001*i, and every participant's result is checked\n"
            "against (P-1)/2 + 0.001*i, P = ranks x N.  mpiexec -n 2 python -m mpigpu.average --devices-per-rank 2"
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
        "--devices-per-rank",
        type=devices_arg,
        default=None,
        metavar="N",
        help="drive N devices from every process (sets MPIGPU_DEVICES_PER_RANK; N from 1 to "
        f"{MAX_DEVICES_PER_RANK}): one thread per device, bound with mpigpu.on_device, fills the gradient "
        "of participant (rank, device) (participant p = the ranks' devices numbered rank by rank; "
        "grad[i] = p + 0.001*i), and the average over every participant (ranks x N) is verified. "
        "GPU processes drive N GPUs each (N x ranks per node <= visible GPUs); without GPUs, N host "
        "devices (NumPy). Backends: auto, nccl, host or cuda-aware (GPU arrays), cpu (host arrays). "
        "Default: one device per process, the one-device call",
    )
    parser.add_argument(
        "--corrupt", type=nonneg_int, default=0, metavar="N", help=argparse.SUPPRESS
    )  # testing aid: damage N results on rank 0 before checking
    return parser


MAX_DEVICES_PER_RANK = 1 << 10  # MPIGPU_DEVICES_PER_RANK's own limit (mpigpu.core.config)


def devices_arg(text: str) -> int:
    """--devices-per-rank: a whole number from 1 to MAX_DEVICES_PER_RANK."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number: give how many devices each process drives (1 or more)"
        ) from None
    if not 1 <= value <= MAX_DEVICES_PER_RANK:
        raise argparse.ArgumentTypeError(f"{value} devices per process: it must be from 1 to {MAX_DEVICES_PER_RANK}")
    return value


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


def _memory_problem(
    ctx: Any, per_rank: int, on_gpu: bool, *, gpus: list[int] | None = None, host_bytes: int | None = None
) -> str | None:
    """Why the buffers of ``per_rank`` bytes cannot fit (the same text on every rank), or None (collective).

    Host memory is the node's, shared by its ranks; GPU memory is each rank's GPU (each of ``gpus``,
    where a process drives several). ``host_bytes``: the host memory each rank needs, where that is not
    ``per_rank`` for host buffers and nothing for GPU ones (several devices: every device's buffers, and
    the rows a gathered path stages). Ranks on other nodes may see other numbers: the first problem
    found, in rank order, is everyone's answer."""
    from mpigpu.core.config import size_label
    from mpigpu.job.memory import gpu_free_bytes, host_available_bytes

    mine = None
    if on_gpu:
        for index in [ctx.gpu.index] if gpus is None else gpus:
            free = gpu_free_bytes(index)
            if free is not None and per_rank > free:
                mine = (
                    f"--size needs {size_label(per_rank)} on each {'rank' if gpus is None else 'device'}'s GPU, "
                    f"but GPU {index} of rank {ctx.rank} has {size_label(free)} free: give a smaller --size"
                )
                break
    need = (0 if on_gpu else per_rank) if host_bytes is None else host_bytes
    if mine is None and need:
        local = ctx.layout.local_size
        available = host_available_bytes()
        if available is not None and need * local > available:
            mine = (
                f"--size needs {size_label(need)} of host memory per rank, {size_label(need * local)} for "
                f"the {local} rank{'s' if local != 1 else ''} on {ctx.layout.hostnames[ctx.rank]}, but it has "
                f"{size_label(available)} available: give a smaller --size"
            )
    problems = ctx.comm.allgather(mine)
    return next((p for p in problems if p is not None), None)


def _set_devices_per_rank(count: int, comm: Any) -> str | None:
    """Make mpigpu start with ``count`` devices per process (MPIGPU_DEVICES_PER_RANK), or say why it is
    too late: it is read when mpigpu first meets a communicator, and a process's GPUs are fixed then.
    Every rank of a command is in the same state, so every rank answers alike."""
    import os

    from mpigpu.job.device import process_devices
    from mpigpu.runtime.context import Context

    ctx = Context.existing(comm)
    gpus = process_devices()
    if ctx is None and not gpus:
        os.environ["MPIGPU_DEVICES_PER_RANK"] = str(count)
        return None
    have = len(gpus) if gpus else (ctx.settings.devices_per_rank or 1) if ctx is not None else 1
    if have == count:
        return None
    return (
        f"--devices-per-rank {count} comes too late: mpigpu has already started in this process with {have} "
        f"device{'s' if have != 1 else ''} per process (MPIGPU_DEVICES_PER_RANK is read when mpigpu first "
        f"meets a communicator). Set MPIGPU_DEVICES_PER_RANK={count} in the environment before the first "
        "mpigpu call instead"
    )


def run(args: argparse.Namespace) -> int:
    from mpigpu.bench.harness import command_stream
    from mpigpu.bench.workload import Workload
    from mpigpu.calls.reduce import prepare
    from mpigpu.calls.reduce import run as run_prepared
    from mpigpu.core._mpi import world
    from mpigpu.core.dtypes import parse_dtype
    from mpigpu.core.errors import DeviceError, MpigpuError
    from mpigpu.core.ops import parse_op
    from mpigpu.core.patterns import check_pattern, default_pattern
    from mpigpu.core.timing import Result, max_over_ranks, max_phases_over_ranks, summarize, time_calls
    from mpigpu.core.verify import total_wrong
    from mpigpu.runtime.context import Context
    from mpigpu.runtime.plan import choose

    comm = world()
    if args.devices_per_rank is not None:
        problem = _set_devices_per_rank(args.devices_per_rank, comm)
        if problem is not None:
            return refuse("mpigpu.average", problem, comm.Get_rank())
    try:
        ctx = Context.get(comm)
    except DeviceError as exc:  # more GPUs asked of each process than its node has: every rank of it says so
        if args.devices_per_rank is None:
            raise
        return refuse("mpigpu.average", f"--devices-per-rank {args.devices_per_rank}: {exc}", comm.Get_rank())
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
    if args.devices_per_rank is not None:
        return run_devices(args, ctx, comm, dtype, op, pattern, on_gpu)
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
        _verdict(ok, wrong, f"over {nranks} rank{'s' if nranks != 1 else ''}")
    if args.json is not None and rank == 0:
        document = {
            **_document(ctx, args, choice, ok, wrong, lines, on_gpu, pattern, kernel_us),
            "backend_settings": backend.describe(),
            "results": [result.to_dict()],
        }
        write_json(args.json, document)
    work.free()
    return 0 if ok else 1


def _participants_text(counts: list[int]) -> str:
    """``4 participants (2 ranks x 2 devices)``, or the devices of each rank where they differ."""
    total, nranks = sum(counts), len(counts)
    if len(set(counts)) == 1:
        layout = f"{nranks} rank{'s' if nranks != 1 else ''} x {counts[0]} device{'s' if counts[0] != 1 else ''}"
    else:
        layout = f"{nranks} ranks, devices per rank {','.join(map(str, counts))}"
    return f"{total} participant{'s' if total != 1 else ''} ({layout})"


class _Meet:
    """The device threads of this process meeting the ranks' other threads: a thread barrier whose
    last arrival runs the MPI barrier (one thread at a time in MPI), aborted when a thread fails so
    that the others raise instead of waiting for it."""

    def __init__(self, count: int, comm: Any) -> None:
        import threading

        self.barrier = threading.Barrier(count, action=comm.Barrier)

    def __call__(self) -> None:
        self.barrier.wait()


def run_devices(args: argparse.Namespace, ctx: Any, comm: Any, dtype: Any, op: Any, pattern: str, on_gpu: bool) -> int:
    """``--devices-per-rank``: one thread per device of this process, each bound with ``on_device``
    and taking part as participant (rank, device); verified and timed like the one-device run."""
    import threading

    import numpy as np

    import mpigpu
    from mpigpu.bench.workload import Workload
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.errors import MpigpuError
    from mpigpu.core.timing import Result, summarize, time_calls
    from mpigpu.core.verify import total_wrong
    from mpigpu.multi import paths
    from mpigpu.multi.group import Group

    rank = ctx.rank
    try:
        group = Group.of(ctx)  # collective: every rank states how many devices it drives
        probe = ArrayView(
            None, 0, (args.size,), dtype, group.gpus[0] if on_gpu and group.gpus else None, False, "numpy",
            host=None if on_gpu else np.empty(0, dtype.np),
        )  # fmt: skip
        choice = paths.choose(group, probe, op, args.backend)  # what the calls will choose: agreed state only
    except MpigpuError as exc:
        return refuse("mpigpu.average", exc, rank)
    count, total, first = group.count, group.total, group.first
    if on_gpu and (group.gpus is None or len(group.gpus) != count):
        return refuse("mpigpu.average", "GPU buffers, but this process drives host devices", rank)
    gpus = list(group.gpus) if on_gpu and group.gpus is not None else None
    nbytes = args.size * dtype.itemsize * (2 if args.out_of_place else 1)
    staging = (total + 1) * args.size * dtype.itemsize if choice.backend in ("host", "cpu") else 0
    host_bytes = staging + (0 if on_gpu else nbytes * count)
    problem = _memory_problem(ctx, nbytes, on_gpu, gpus=gpus, host_bytes=host_bytes)
    if problem is not None:
        return refuse("mpigpu.average", problem, rank)
    counts = [int(c) for c in group.counts]
    described = ", ".join(group.describe(k) for k in range(count))
    mine = f"#  Rank {rank:3d} drives {described}: participant{'s' if count != 1 else ''} " + (
        f"{first}" if count == 1 else f"{first}-{first + count - 1}"
    )
    lines = header_lines(ctx)
    devices_lines = comm.gather(mine, root=0)
    where = "GPU" if on_gpu else "host"
    if rank == 0 and not args.quiet:
        print("\n".join(lines))
        print(f"# {_participants_text(counts)}: one thread per device (mpigpu.on_device)")
        print("\n".join(devices_lines))
        print(f"# backend: {args.backend} -> {choice.backend} ({choice.reason})")
        print(
            f"# {args.size} {dtype.name} elements per participant, op {op.value}, pattern {pattern}, "
            f"{where} memory, {'out of place' if args.out_of_place else 'in place'}"
        )
        if total == 1:
            print("# 1 participant: there is nothing to average across; the result is the input, still verified")
        sys.stdout.flush()

    meet = _Meet(count, comm)
    wrong = [0] * count
    means: list[list[float]] = [[] for _ in range(count)]
    kernel_ms = [0.0] * count
    errors: list[BaseException | None] = [None] * count

    def device(k: int) -> None:
        try:
            with mpigpu.on_device(k) as ordinal:
                _device_turn(k, ordinal)
        except BaseException as exc:  # re-raised by the main thread
            errors[k] = exc
            meet.barrier.abort()

    def _device_turn(k: int, ordinal: int | None) -> None:
        participant = first + k
        stream_ref, keep = None, None
        gpu = runtime = None
        if on_gpu:
            from mpigpu.core._cuda import StreamRef, cupy, set_device, visible_device_count
            from mpigpu.job.device import _describe

            cp = cupy()
            runtime = cp.cuda.runtime
            gpu = _describe(ordinal, visible_device_count())
            with cp.cuda.Device(ordinal):
                keep = cp.cuda.Stream(non_blocking=True)  # lives as long as its ref is used
            stream_ref = StreamRef(int(keep.ptr))
        work = Workload.allocate(
            count=args.size, dtype=dtype, op=op, pattern=pattern, rank=participant, nranks=total,
            device=gpu, inplace=not args.out_of_place, stream=stream_ref,
        )  # fmt: skip
        kwargs: dict[str, Any] = {"backend": args.backend, "stream": stream_ref}
        if work.out is not work.x:
            kwargs["out"] = work.out

        def call() -> Any:
            result = mpigpu.allreduce(work.x, op.value, **kwargs)
            if runtime is not None and runtime.getDevice() != ordinal:
                set_device(ordinal)  # the thread that led the call may come back on another GPU: this one again
            return result

        try:
            if args.check:
                work.fill()
                work.poison()
                call()
                if participant == 0:
                    work.corrupt(args.corrupt)
                wrong[k] = work.wrong()
            work.fill()
            kernel_ms[k] = work.kernel_ms
            for _ in range(args.warmup):
                call()
            means[k] = time_calls(call, args.iters, barrier=meet, stream=stream_ref)
        finally:
            work.free()

    threads = [threading.Thread(target=device, args=(k,), name=f"mpigpu.average device {k}") for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failures = [e for e in errors if e is not None]
    if failures:  # the thread's own error first, not a broken barrier another thread's failure left
        raise next((e for e in failures if not isinstance(e, threading.BrokenBarrierError)), failures[0])

    wrong_all = total_wrong(comm, sum(wrong)) if args.check else -1
    mine_means = [summarize(m) for m in means]  # (mean, median, spread) per device
    everyone = [row for rows in comm.allgather(mine_means) for row in rows]  # participant order
    per_participant = tuple(float(mean) for mean, _, _ in everyone)
    kernel_us = max(comm.allgather(max(kernel_ms) * 1e3))
    result = Result(
        bytes=args.size * dtype.itemsize, elements=args.size, dtype=dtype.name, op=op.value,
        backend=choice.backend, ranks=total, time_us=max(per_participant), wrong=wrong_all,
        inplace=not args.out_of_place, median_us=max(median for _, median, _ in everyone),
        spread_us=max(spread for _, _, spread in everyone), per_rank_us=per_participant,
    )  # fmt: skip
    ok = wrong_all <= 0
    summary = f"{_participants_text(counts)}, backend {choice.backend}"
    if rank == 0:
        if not args.quiet:
            print(ROW_HEADER)
        print(format_row(result))
        if on_gpu and not args.quiet:
            print(f"# gradient kernel: {kernel_us:.1f} us")
        if not args.quiet:
            print("# time: the slowest participant's mean per call; busbw counts every participant")
        _verdict(ok, wrong_all, f"over {summary}")
    if args.json is not None and rank == 0:
        header = lines + list(devices_lines)
        document = {
            **_document(ctx, args, choice, ok, wrong_all, header, on_gpu, pattern, kernel_us),
            "devices_per_rank": counts,
            "participants": total,
            "threads": "one per device (mpigpu.on_device)",
            "results": [{**result.to_dict(), "per_participant_us": list(per_participant)}],
        }
        write_json(args.json, document)
    return 0 if ok else 1


def _document(
    ctx: Any,
    args: Any,
    choice: Any,
    ok: bool,
    wrong: int,
    header: list[str],
    on_gpu: bool,
    pattern: str,
    kernel_us: float,
) -> dict[str, Any]:
    """What --json writes about the job and the run, in both forms of the command (one device per
    process, or several); each adds its own results."""
    from mpigpu.kernels.compile import compile_stats

    return {
        "ok": ok,
        "verified": wrong >= 0,
        "ranks": ctx.size,
        "backend": choice.backend,
        "backend_requested": args.backend,
        "backend_reason": choice.reason,
        "mpi_library": ctx.mpi_lib.name,
        "mpi_version": ctx.mpi_lib.version,
        "cuda_aware": {"aware": ctx.cuda_aware.aware, "rule": ctx.cuda_aware.rule},
        "nccl": ctx.nccl.version if ctx.nccl.available else None,
        "nodes": ctx.layout.num_nodes,
        "header": header,
        "placement": "gpu" if on_gpu else "host",
        "pattern": pattern,
        "kernel_us": kernel_us if on_gpu else None,
        "compile": [vars(s) for s in compile_stats()],
        "versions": versions(),
        "date": now(),
    }  # fmt: skip


def _verdict(ok: bool, wrong: int, over: str) -> None:
    """The command's last line: PASS/FAIL with the wrong elements (-1: not verified), ``over`` whom."""
    if wrong < 0:
        print(f"# NOT VERIFIED (--no-check): the results were not compared with the expected values {over}")
    else:
        print(f"# {'PASS' if ok else 'FAIL'}: {wrong} wrong element{'s' if wrong != 1 else ''} {over}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_command(build_parser(), argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
