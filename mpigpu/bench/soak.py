"""``mpiexec -n N python -m mpigpu.bench.soak``: thousands of allreduce calls with random sizes, dtypes,
ops, backends, placements (host/GPU), element offsets and in/out of place, each verified exactly,
with memory measured before and after.

Rank 0 draws the seed (printed; ``--seed`` repeats a run) and broadcasts it; every rank then draws
the same sequence of calls. Inputs follow the 'exact' pattern, whose reductions are exact in every
dtype and order, so every element is compared with its expected value; a separate output is
poisoned before the call, and the input of an out-of-place call must come back unchanged.

Memory: after a warm-up (one call at the largest size per placement, backend and in/out of place;
then, with ``--warm-up variants``, the default, each variant the random calls can meet: placement x
backend x dtype x op, once small, misaligned and out of place and once at the largest size in place,
so that every kernel is compiled or loaded, and NVRTC with it, before memory is measured) and half the
calls, the resident set size, CuPy's device pool and the device's free memory are recorded, and again
at the end. The growth may not exceed ``--mem-slack`` MiB plus four times the largest message: backends
may still allocate a few reused buffers of up to that size lazily, but anything that grows with the
number of calls exceeds it. Rank 0's RSS is also reported after the warm-up, after each variant first
met in the random calls (placement, backend run, dtype, op; with the shared libraries mapped since the
line before, e.g. NVRTC), and at the end.

``--check-cost`` measures the cross-rank argument check instead (MPIGPU_CHECK): the time per call of
a small allreduce with the check on and off, on every backend, interleaved in one run.

Exit status: 0 if no element was wrong and memory stayed within its bound, 1 otherwise, 2 for
invalid options.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import secrets
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from mpigpu.bench import harness
from mpigpu.bench.workload import Buffers, Workload
from mpigpu.cli import (
    Parser,
    choice_arg,
    comma_list,
    count_arg,
    header_lines,
    nonneg_int,
    parse_command,
    positive_int,
    prog,
    versions,
    write_json,
)
from mpigpu.core.dtypes import DTYPES, DType, parse_dtype
from mpigpu.core.ops import Op

__all__ = ["SoakResult", "main", "run_soak"]

MAX_OFFSET = 64  # elements: random offsets in [1, 64) make misaligned buffers
SMALL = 3  # elements of the warm-up's small misaligned call


@dataclasses.dataclass
class Memory:
    """One rank's memory at one moment."""

    rss: int
    objects: int
    device_used: int = 0  # CuPy's default pool: bytes in use
    device_free: int = 0  # cudaMemGetInfo: free bytes on the device
    pools: dict[str, int] = dataclasses.field(default_factory=dict)  # backends' describe() byte counts


@dataclasses.dataclass
class RssMark:
    """Rank 0's resident set size at one moment of the run, and the shared libraries mapped since the
    mark before (the first mark: their count)."""

    at: str  # "after warm-up", "call 17: first float16 prod on host (GPU)", "at the end"
    rss: int
    new_libraries: list[str]


@dataclasses.dataclass
class SoakResult:
    """What a soak run found (the same on every rank, except ``memory``)."""

    seed: int
    calls: int
    warm_up: int  # calls at the largest size before the random ones
    skipped: int
    wrong: int
    failures: list[str]  # the first failing calls, from every rank
    bytes_moved: int  # this rank's input bytes over all calls
    counts: dict[str, dict[str, int]]  # calls by requested backend, backend run, placement, layout
    before: Memory
    after: Memory
    bound: int  # bytes of growth allowed
    growth: dict[str, int]  # max over ranks: rss, device
    elapsed: float
    rss_trace: list[RssMark] = dataclasses.field(default_factory=list)  # rank 0's RSS at its marks

    @property
    def memory_ok(self) -> bool:
        return all(v <= self.bound for v in self.growth.values())

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and self.memory_ok

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["ok"], data["memory_ok"] = self.ok, self.memory_ok
        return data


# -- memory ----------------------------------------------------------------------------------------
def _rss() -> int:
    """Resident set size of this process in bytes (Linux /proc; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _libraries() -> set[str]:
    """The shared objects mapped into this process (names; empty where /proc/self/maps is absent)."""
    try:
        with open("/proc/self/maps") as maps:
            return {Path(line.split(None, 5)[5].strip()).name for line in maps if ".so" in line and "/" in line}
    except (OSError, IndexError):
        return set()


def _memory(ctx: Any, on_gpu: bool, used_backends: set[str]) -> Memory:
    gc.collect()
    snapshot = Memory(rss=_rss(), objects=len(gc.get_objects()))
    if on_gpu:
        from mpigpu.core._cuda import cupy

        cp = cupy()
        cp.cuda.runtime.deviceSynchronize()
        snapshot.device_used = int(cp.get_default_memory_pool().used_bytes())
        snapshot.device_free = int(cp.cuda.runtime.memGetInfo()[0])
    for name in sorted(used_backends):
        for key, value in ctx.backend(name).describe().items():
            if "bytes" in key and isinstance(value, int) and not isinstance(value, bool):
                snapshot.pools[f"{name}.{key}"] = value
    return snapshot


# -- the soak ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Call:
    index: int
    count: int
    dtype: DType
    op: Op
    gpu: bool
    inplace: bool
    offset: int
    backend: str

    def describe(self) -> str:
        which = "warm-up call" if self.index < 0 else f"call {self.index}"
        return (
            f"{which}: {self.count} x {self.dtype.name} op={self.op.value} backend={self.backend} "
            f"{'GPU' if self.gpu else 'host'} {'in place' if self.inplace else 'out of place'} offset={self.offset}"
        )


Variant = tuple[bool, str, str, str]  # GPU placement, backend run, dtype, op: what may load a kernel


def _describe_variant(variant: Variant) -> str:
    gpu, backend, dtype, op = variant
    return f"{dtype} {op} on {backend} ({'GPU' if gpu else 'host'})"


def _candidates(ctx: Any, work: Workload, allowed: list[str]) -> list[str]:
    """Backends (and 'auto') that take this call here: the same list on every rank."""
    from mpigpu.core.errors import MpigpuError
    from mpigpu.runtime.plan import choose

    found = []
    for name in allowed:
        with contextlib.suppress(MpigpuError):
            choose(ctx, work.x, work.op, name)
            found.append(name)
    return found


class _Soak:
    """The random call sequence and its execution on one communicator."""

    def __init__(self, ctx: Any, args: argparse.Namespace, seed: int, placements: list[bool]) -> None:
        self.ctx, self.args, self.seed = ctx, args, seed
        self.rng = np.random.default_rng(seed)
        self.dtypes = [parse_dtype(d) for d in args.dtypes]
        self.ops = [Op(o) for o in args.ops]
        self.backends = args.backends
        self.stream = None
        if any(placements):
            self._cupy_stream, self.stream = harness.command_stream(ctx)
        max_bytes = args.max_size * max(d.itemsize for d in self.dtypes)
        self.max_bytes = max_bytes
        arena = max_bytes + MAX_OFFSET * 8  # room for the largest call at the largest offset
        self.buffers = {gpu: Buffers(arena, ctx.gpu if gpu else None, output=True, snapshot=True) for gpu in placements}
        self.placements = placements
        self.used: set[str] = set()
        self.counts: dict[str, Counter[str]] = {k: Counter() for k in ("requested", "ran", "memory", "layout")}
        self.failures: list[str] = []
        self.wrong = 0
        self.bytes_moved = 0
        self.skipped = 0
        self.nonempty = 0
        self.seen: set[Variant] = set()
        self.trace: list[RssMark] = []
        self._mapped: set[str] = set()

    def mark(self, at: str) -> None:
        """Rank 0: record its RSS now and the libraries mapped since the last mark."""
        if self.ctx.rank != 0:
            return
        mapped = _libraries()
        new = sorted(mapped - self._mapped) if self.trace else [f"{len(mapped)} shared objects"]
        self._mapped = mapped
        self.trace.append(RssMark(at, _rss(), new))

    def draw(self, index: int) -> Call | None:
        """The next call, drawn identically on every rank (None: no backend takes it here)."""
        rng, max_size = self.rng, self.args.max_size
        log_size = rng.uniform(0, math.log(max_size))  # log-uniform: as many small messages as large ones
        count = 0 if rng.random() < 0.02 else min(max_size, max(1, round(math.exp(log_size))))
        dtype = self.dtypes[rng.integers(len(self.dtypes))]
        op = self.ops[rng.integers(len(self.ops))]
        gpu = self.placements[rng.integers(len(self.placements))]
        inplace = bool(rng.random() < 0.5)
        offset = int(rng.integers(1, MAX_OFFSET)) if self.args.offsets and rng.random() < 0.5 else 0
        pick = rng.random()
        names = _candidates(self.ctx, self.workload(gpu, count, dtype, op, True), self.backends)
        if not names:
            return None
        return Call(index, count, dtype, op, gpu, inplace, offset, names[int(pick * len(names))])

    def workload(self, gpu: bool, count: int, dtype: DType, op: Op, inplace: bool, offset: int = 0) -> Workload:
        """One call's view of the placement's buffers (input pattern 'exact': checked exactly)."""
        return Workload(
            self.buffers[gpu], count=count, dtype=dtype, op=op, pattern="exact", rank=self.ctx.rank,
            nranks=self.ctx.size, inplace=inplace, stream=self.stream if gpu else None, offset=offset,
        )  # fmt: skip

    def execute(self, call: Call) -> None:
        """Run one call and verify it; a wrong result is recorded, an exception names the call."""
        import mpigpu
        from mpigpu.runtime.plan import choose

        ctx, rank = self.ctx, self.ctx.rank
        try:
            work = self.workload(call.gpu, call.count, call.dtype, call.op, call.inplace, call.offset)
            if call.count:
                work.fill()  # out of place: also keeps a copy of the input, which must come back unchanged
                work.poison()
            resolved = choose(ctx, work.x, call.op, call.backend).backend
            out = None if call.inplace else work.out
            mpigpu.allreduce(work.x, call.op, out=out, backend=call.backend, stream=self.stream)
            wrong = 0
            if call.count:
                self.nonempty += 1
                if self.nonempty == self.args.corrupt and rank == 0:
                    work.corrupt(1)
                wrong = work.wrong()
        except Exception:
            sys.stderr.write(f"[mpigpu soak, rank {rank}] seed {self.seed}, {call.describe()} raised:\n")
            raise
        self.used.add(resolved)
        variant = (call.gpu, resolved, call.dtype.name, call.op.value)
        if variant not in self.seen:
            self.seen.add(variant)
            if call.index >= 0:  # a random call met it first: the warm-up missed it
                self.mark(f"call {call.index}: first {_describe_variant(variant)}")
        self.counts["requested"][call.backend] += 1
        self.counts["ran"][resolved] += 1
        self.counts["memory"]["GPU" if call.gpu else "host"] += 1
        self.counts["layout"].update(
            ["in place" if call.inplace else "out of place"]
            + (["zero-size"] if not call.count else [])
            + (["offset"] if call.offset else [])
        )
        self.bytes_moved += call.count * call.dtype.itemsize
        if wrong:
            self.wrong += wrong
            self.failures.append(f"rank {rank}: {call.describe()}: {wrong} wrong")

    def warm_up(self) -> None:
        """One call at the largest size per placement, backend and in/out of place: pools and
        buffers reach their high-water mark before memory is first measured. With ``--warm-up
        variants``, then every placement x backend x dtype x op twice (small, misaligned, out of place;
        largest, in place): each kernel the random calls may use, and NVRTC where one is compiled, is
        loaded now, not between the two measurements."""
        dtype = max(self.dtypes, key=lambda d: d.itemsize)
        op = Op.SUM if Op.SUM in self.ops else self.ops[0]
        largest = self.args.max_size
        for gpu in self.placements:
            for name in _candidates(self.ctx, self.workload(gpu, largest, dtype, op, True), self.backends):
                for inplace in (True, False):
                    self.execute(Call(-1, largest, dtype, op, gpu, inplace, 0, name))
        if self.args.warm_up == "variants":
            small, offset = min(SMALL, largest), 1 if self.args.offsets else 0
            for gpu in self.placements:
                for dtype in self.dtypes:
                    for op in self.ops:
                        for name in _candidates(self.ctx, self.workload(gpu, small, dtype, op, True), self.backends):
                            self.execute(Call(-1, small, dtype, op, gpu, False, offset, name))
                            self.execute(Call(-1, largest, dtype, op, gpu, True, 0, name))
        # Set up every backend now (collective, same order everywhere). With one rank the calls above
        # reach no backend (a copy is the whole allreduce), and the memory report, which asks each
        # used backend to describe itself, would otherwise create them between its two snapshots.
        for name in sorted(self.used):
            self.ctx.backend(name)


def _placements(ctx: Any, device: str) -> list[bool]:
    """Host first: the order the random draws index (a seed repeats a run)."""
    return sorted(harness.placements(ctx, device))


def _agree_seed(comm: Any, seed: int | None) -> int:
    return int(comm.bcast(secrets.randbelow(2**31) if seed is None else seed, root=0))


def run_soak(args: argparse.Namespace, progress: bool = True) -> SoakResult:
    """The soak on the world communicator (collective); the result is complete on every rank."""
    from mpigpu.core._mpi import MPI, world
    from mpigpu.runtime.context import Context

    comm = world()
    ctx = Context.get(comm)
    seed = _agree_seed(comm, args.seed)
    placements = _placements(ctx, args.device)
    soak = _Soak(ctx, args, seed, placements)
    header = header_lines(ctx)  # collective
    if ctx.rank == 0 and progress:
        print("\n".join(header))
        print(
            f"# soak: seed {seed} (repeat with --seed {seed}), {args.calls} calls, sizes 0..{args.max_size} "
            f"elements, {'host and GPU' if len(placements) == 2 else 'GPU' if placements[0] else 'host'} memory, "
            f"backends {', '.join(args.backends)}, dtypes {', '.join(args.dtypes)}, ops {', '.join(args.ops)}"
        )
        sys.stdout.flush()
    start = time.monotonic()
    soak.warm_up()
    soak.mark(f"after warm-up ({soak.nonempty} calls, {len(soak.seen)} variants)")
    # Memory is measured half-way and at the end: one-time allocations (lazy backend set-up, other
    # libraries in the same process such as JAX or NCCL) land before the middle; a leak keeps growing.
    warm = max(1, args.calls // 2)
    before = None
    warmed_up = soak.nonempty
    for index in range(args.calls):
        if index == warm:
            before = _memory(ctx, any(placements), soak.used)
        call = soak.draw(index)
        if call is None:
            soak.skipped += 1
            continue
        soak.execute(call)
        if progress and ctx.rank == 0 and (index + 1) % max(1, args.calls // 10) == 0:
            sys.stderr.write(f"[soak] {index + 1}/{args.calls} calls, {soak.wrong} wrong on rank 0\n")
    if before is None:
        before = _memory(ctx, any(placements), soak.used)
    after = _memory(ctx, any(placements), soak.used)
    soak.mark("at the end")
    elapsed = time.monotonic() - start
    wrong = int(comm.allreduce(soak.wrong, op=MPI().SUM))
    failures = [f for per_rank in comm.allgather(soak.failures[:10]) for f in per_rank]
    growth = {"rss": after.rss - before.rss}
    if any(placements):
        growth["device_pool"] = after.device_used - before.device_used
        growth["device_free_drop"] = before.device_free - after.device_free
    growth = {k: int(comm.allreduce(v, op=MPI().MAX)) for k, v in growth.items()}
    return SoakResult(
        seed=seed, calls=args.calls - soak.skipped, warm_up=warmed_up, skipped=soak.skipped, wrong=wrong,
        failures=failures,
        bytes_moved=soak.bytes_moved, counts={k: dict(sorted(v.items())) for k, v in soak.counts.items()},
        before=before, after=after,
        bound=(args.mem_slack << 20) + 4 * soak.max_bytes, growth=growth, elapsed=elapsed, rss_trace=soak.trace,
    )  # fmt: skip


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):+.1f} MiB" if abs(nbytes) >= 50 << 10 else "+0.0 MiB"


def report(result: SoakResult) -> str:
    """The summary rank 0 prints."""
    lines = [
        f"# calls     {result.calls} random + {result.warm_up} warm-up calls verified"
        + (f" ({result.skipped} drawn calls had no backend here and were skipped)" if result.skipped else ""),
        "# mix       "
        + " | ".join(f"{kind}: " + ", ".join(f"{k} {v}" for k, v in c.items()) for kind, c in result.counts.items()),
        f"# bytes     {result.bytes_moved / (1 << 20):.1f} MiB of input per rank in {result.elapsed:.1f} s",
        f"# wrong     {result.wrong} element{'s' if result.wrong != 1 else ''}",
    ]
    lines += [f"#   {failure}" for failure in result.failures]
    before, after = result.before, result.after
    memory = f"RSS {before.rss >> 20} -> {after.rss >> 20} MiB on rank 0"
    if after.device_free:
        memory += (
            f"; device pool in use {before.device_used >> 20} -> {after.device_used >> 20} MiB, "
            f"device free {before.device_free >> 20} -> {after.device_free >> 20} MiB"
        )
    lines.append(f"# memory    {memory}; Python objects {after.objects - before.objects:+d}")
    first = result.rss_trace[0].rss if result.rss_trace else 0
    for mark in result.rss_trace:
        libraries = f"; new libraries: {', '.join(mark.new_libraries)}" if mark.new_libraries else ""
        lines.append(f"# rss       {mark.at}: {mark.rss >> 20} MiB on rank 0 ({_mib(mark.rss - first)}){libraries}")
    growth = ", ".join(f"{k} {_mib(v)}" for k, v in result.growth.items())
    lines.append(f"# growth    max over ranks after warm-up: {growth} (bound {result.bound >> 20} MiB)")
    pools = [
        f"{k} {before.pools.get(k, 0)} -> {after.pools.get(k, 0)}" for k in sorted(set(before.pools) | set(after.pools))
    ]
    if pools:
        lines.append(f"# backends  (bytes, describe()) {', '.join(pools)}")
    verdict = "PASS" if result.ok else "FAIL"
    why = [] if result.wrong == 0 else [f"{result.wrong} wrong elements"]
    why += [] if result.memory_ok else ["memory grew beyond the bound"]
    lines.append(
        f"# {verdict}: seed {result.seed}, {result.calls} calls, rss {_mib(result.growth['rss'])}"
        + (f": {'; '.join(why)}" if why else "")
    )
    return "\n".join(lines)


# -- the cost of the cross-rank check ---------------------------------------------------------------
def check_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time per call of a ``--check-bytes`` float32 avg allreduce with the check on and off, per
    backend and placement (collective). Medians over repetitions, each the max over ranks."""
    import mpigpu
    from mpigpu.backends import backend_code
    from mpigpu.core._mpi import world
    from mpigpu.core.timing import max_over_ranks, time_calls
    from mpigpu.job.check import Signature, check_signature
    from mpigpu.runtime.context import Context

    comm = world()
    ctx = Context.get(comm)
    count = max(1, args.check_bytes // 4)
    dtype = DTYPES["float32"]
    rows = []
    for gpu in _placements(ctx, args.device):
        streams = harness.command_stream(ctx) if gpu else (None, None)  # the CuPy stream lives as long as its ref
        stream = streams[1]
        work = Workload.allocate(
            count=count, dtype=dtype, op=Op.AVG, pattern="exact", rank=ctx.rank, nranks=ctx.size,
            device=ctx.gpu if gpu else None, stream=stream,
        )  # fmt: skip
        x = work.x
        # the check alone: its cost does not depend on which backend the signature names
        signature = Signature(count, dtype.code, Op.AVG.code, backend_code("cpu"), int(gpu))

        def check(signature: Signature = signature) -> None:
            check_signature(comm, signature)

        alone = [
            max_over_ranks(comm, time_calls(check, args.iters, barrier=comm.Barrier)[0])[0] for _ in range(args.repeats)
        ]
        for name in _candidates(ctx, work, args.backends):

            def call(name: str = name, x: Any = x, stream: Any = stream) -> Any:
                return mpigpu.allreduce(x, "avg", backend=name, stream=stream)

            def timed(func: Any, stream: Any = stream) -> float:
                mean = time_calls(func, args.iters, barrier=comm.Barrier, stream=stream)[0]
                return max_over_ranks(comm, mean)[0]

            for _ in range(min(100, args.iters)):
                call()
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.repeats):
                for on in (True, False):
                    with ctx.changed_settings(check=on):
                        times[on].append(timed(call))
            rows.append(
                {
                    "placement": "GPU" if gpu else "host", "backend": name, "bytes": count * 4,
                    "check_on_us": statistics.median(times[True]), "check_off_us": statistics.median(times[False]),
                    "check_alone_us": statistics.median(alone),
                }
            )  # fmt: skip
    return rows


def report_cost(rows: list[dict[str, Any]], args: argparse.Namespace, nranks: int) -> str:
    lines = [
        f"# argument check (MPIGPU_CHECK) cost: float32 avg, {nranks} ranks, {args.iters} calls x "
        f"{args.repeats} repetitions, on/off interleaved; median of repetitions, each the max over ranks",
        f"# {'place':<5} {'backend':<11} {'bytes':>6} {'check on (us)':>14} {'check off (us)':>15} "
        f"{'cost (us)':>10} {'cost (%)':>9} {'check alone (us)':>17}",
    ]
    for row in rows:
        cost = row["check_on_us"] - row["check_off_us"]
        share = 100 * cost / row["check_on_us"] if row["check_on_us"] > 0 else 0.0
        lines.append(
            f"  {row['placement']:<5} {row['backend']:<11} {row['bytes']:>6} {row['check_on_us']:>14.2f} "
            f"{row['check_off_us']:>15.2f} {cost:>10.2f} {share:>9.1f} {row['check_alone_us']:>17.2f}"
        )
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------------
def _names(choices: list[str], what: str) -> Any:
    """A comma list of some of ``choices``."""
    return comma_list(choice_arg(choices, what), f"{what}s")


def build_parser() -> Parser:
    from mpigpu.backends import BACKEND_NAMES

    parser = Parser(
        prog=prog("mpigpu.bench.soak"),
        description=(
            "Soak test: many allreduce calls with random sizes, dtypes, ops, backends, placements and\n"
            "offsets, each verified exactly; memory measured before and after. Run it under your launcher:\n"
            "  mpiexec -n 4 python -m mpigpu.bench.soak --calls 5000"
        ),
        epilog="exit status: 0 if every element was right and memory stayed bounded, 1 otherwise, "
        "2 for invalid options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--calls", type=positive_int, default=1000, help="random calls (default 1000)")
    parser.add_argument("--seed", type=nonneg_int, default=None, help="repeat a run (default: drawn by rank 0)")
    parser.add_argument(
        "--max-size", type=count_arg, default=count_arg("1M"), help="largest element count (default 1M = 1048576)"
    )
    parser.add_argument(
        "--device",
        choices=["auto", "gpu", "cpu", "both"],
        default="auto",
        help="where arrays live: auto = host and GPU when every rank has a GPU, else host",
    )
    backends = ["auto", *BACKEND_NAMES]
    parser.add_argument(
        "--backends",
        type=_names(backends, "backend"),
        default=backends,
        help="comma list of backends to draw from (default: all, and auto); unavailable ones are skipped",
    )
    parser.add_argument("--dtypes", type=_names(list(DTYPES), "dtype"), default=list(DTYPES), help="comma list")
    parser.add_argument("--ops", type=_names([o.value for o in Op], "op"), default=[o.value for o in Op])
    parser.add_argument(
        "--offsets",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start half of the buffers 1..63 elements into their allocation (misaligned; default on)",
    )
    parser.add_argument(
        "--mem-slack", type=nonneg_int, default=64, metavar="MIB", help="allowed growth besides 4 x the largest message"
    )
    parser.add_argument(
        "--warm-up",
        choices=["variants", "largest"],
        default="variants",
        help="variants (default): also run every placement x backend x dtype x op once before memory is "
        "measured; largest: only the largest calls (shows what a variant first met later costs)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the result as JSON")
    parser.add_argument("--quiet", action="store_true", help="no header or progress")
    parser.add_argument("--check-cost", action="store_true", help="measure the cross-rank argument check instead")
    parser.add_argument("--check-bytes", type=count_arg, default=8, help="message size for --check-cost (default 8)")
    parser.add_argument("--iters", type=positive_int, default=2000, help="--check-cost: calls per repetition")
    parser.add_argument("--repeats", type=positive_int, default=5, help="--check-cost: repetitions (default 5)")
    parser.add_argument("--corrupt", type=nonneg_int, default=0, help=argparse.SUPPRESS)  # damage call N on rank 0
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_command(build_parser(), argv)
    from mpigpu.core._mpi import world

    comm = world()
    if args.check_cost:
        rows = check_cost(args)
        if comm.Get_rank() == 0:
            print(report_cost(rows, args, comm.Get_size()))
            if args.json:
                write_json(args.json, {"check_cost": rows, "versions": versions()})
        return 0
    result = run_soak(args, progress=not args.quiet)
    if comm.Get_rank() == 0:
        print(report(result))
        if args.json:
            write_json(
                args.json, {"command": sys.argv, "ranks": comm.Get_size(), "versions": versions(), **result.to_dict()}
            )
        sys.stdout.flush()
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
