"""The sweep of ``python -m mpigpu.bench``: which paths to time (mpigpu backends and auto, each
called the ways ``--calls`` names; the raw anchor beside each backend; the torch.distributed
anchors), and the measurement of every path at each size: each verified first (fresh input,
poisoned output, every element checked, through the very call that is then timed), then all timed
on the wall clock (``mpigpu.bench.calls``), interleaved in rounds (``mpigpu.bench.rounds``).
``--collective broadcast|allgather|reduce_scatter|alltoall`` swaps in the buffers, calls and
anchors of ``mpigpu.bench.collectives``. Collective: every rank runs the same sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from mpigpu.backends import BACKEND_NAMES
from mpigpu.bench.anchors import ANCHORS, anchor_for
from mpigpu.bench.calls import bind_call, time_turn
from mpigpu.bench.coll_anchors import COLLECTIVE_ANCHORS
from mpigpu.bench.collectives import CollectiveResult, CollectiveWorkload, bind_collective
from mpigpu.bench.harness import command_stream, placements
from mpigpu.bench.report import PLACE_LABEL, Measurement, PathSpec, fastest_backends, median_us
from mpigpu.bench.rounds import Figures, Turn, figures, run_rounds
from mpigpu.bench.workload import Workload
from mpigpu.core.dtypes import DType
from mpigpu.core.errors import MpigpuError
from mpigpu.core.ops import Op
from mpigpu.core.timing import Result
from mpigpu.runtime.tuning import size_label

__all__ = ["MAX_ITERS", "TARGET_TURN_S", "Interrupted", "Sweep", "plan_paths"]

# adaptive iteration count: about this long per path and round (5 rounds: 0.15 s per path and size,
# what 3 repetitions of 50 ms took before the rounds)
TARGET_TURN_S = 0.03
MAX_ITERS = 1000
# calls timed to size the turns, their median taken: sized from one call, a call caught by a burst of
# load cut a path's turns to a few calls on the loaded 2-core machine, and its figure to their noise
CALIBRATION_CALLS = 3


# -- paths --------------------------------------------------------------------------------------
def _placements(args: argparse.Namespace, ctx: Any) -> list[str]:
    """--placement as the sweep's placements, GPU buffers first."""
    return ["device" if gpu else "host" for gpu in placements(ctx, args.placement, option="--placement")]


def anchor_classes(collective: str) -> dict[str, Any]:
    """The anchors of ``collective``: allreduce's (``mpigpu.bench.anchors``) or broadcast/allgather's."""
    return ANCHORS if collective == "allreduce" else COLLECTIVE_ANCHORS


def plan_paths(ctx: Any, args: argparse.Namespace) -> tuple[list[PathSpec], list[str]]:
    """The paths to time, in order (anchors before the backends that refer to them, auto last; a
    backend or auto once per call in ``args.calls``), and a line for each one that cannot run here."""
    from mpigpu.backends import backend_class

    collective = getattr(args, "collective", "allreduce")
    anchors = anchor_classes(collective)
    wanted = set(args.backends or [*BACKEND_NAMES, *anchors])
    skipped: list[str] = []
    backends = []
    for name in BACKEND_NAMES:
        if name not in wanted:
            continue
        available = ctx.availability[name]
        if collective not in backend_class(name).collectives:
            skipped.append(f"{name}: does not implement {collective}")
        elif available.ok:
            backends.append(name)
        else:
            skipped.append(f"{name}: {available.reason}")
    paths: list[PathSpec] = []
    for placement in _placements(args, ctx):
        mine = []
        for name in backends:
            cls = backend_class(name)
            if cls.device_arrays if placement == "device" else cls.host_arrays:
                anchor = anchor_for(placement, name)
                anchor = anchor if anchor in anchors else None
                mine += [PathSpec(name, "backend", placement, anchor, c) for c in args.calls]
        needed = {p.anchor for p in mine} | {a for a in wanted if a in anchors}
        skipped += [f"{a}: no {collective} anchor" for a in sorted(wanted) if a in ANCHORS and a not in anchors]
        for name, cls in anchors.items():
            if name in needed and cls.placement == placement:
                problem = cls.unavailable(ctx)
                if problem is None:
                    paths.append(PathSpec(name, "anchor", placement))
                elif f"{name}: {problem}" not in skipped:
                    skipped.append(f"{name}: {problem}")
        paths.extend(mine)
        if "auto" in wanted and not args.tune:
            paths += auto_paths(placement, args.calls)
    timed = {p.placement for p in paths}
    for name, cls in anchors.items():  # an anchor of arrays this run does not time: said, with why
        if name in wanted and cls.placement not in timed and not any(line.startswith(f"{name}: ") for line in skipped):
            problem = cls.unavailable(ctx)  # collective (the torch anchors agree across ranks)
            where = "GPU buffers" if cls.placement == "device" else "host arrays"
            skipped.append(f"{name}: {problem or f'{where} are not timed in this run (--placement)'}")
    return paths, skipped


def auto_paths(placement: str, calls: list[str]) -> list[PathSpec]:
    return [PathSpec("auto", "auto", placement, None, c) for c in calls]


def _unsupported(ctx: Any, path: PathSpec, dtype: DType, op: Op, collective: str) -> str | None:
    from mpigpu.backends import backend_class

    if path.kind == "anchor":
        cls = anchor_classes(collective)[path.name]
        return cls.supports(dtype, op) or (None if collective == "allreduce" else cls.refuses(collective, dtype))
    if collective not in ("allreduce", "reduce_scatter"):  # data movement: bytes, any dtype
        return None
    if path.kind == "backend":
        return backend_class(path.name).supports(dtype, op)
    return None


# -- measuring ----------------------------------------------------------------------------------
class Interrupted(Exception):
    """Ctrl-C (SIGINT) reached a rank: every rank stops the sweep at the same point."""


class Sweep:
    """Runs the measurements of one benchmark (collective: every rank runs the same sequence)."""

    def __init__(self, ctx: Any, args: argparse.Namespace) -> None:
        self.ctx, self.args, self.comm = ctx, args, ctx.comm
        self.collective: str = getattr(args, "collective", "allreduce")
        self.rank = ctx.rank
        self.stopped: list[str] = []
        self.unsupported: list[str] = []
        self.measurements: list[Measurement] = []
        self.rechecks: list[Measurement] = []  # fastest backends re-timed beside auto
        self._anchors: dict[str, Any] = {}
        self._sigint = False  # this rank got Ctrl-C (stop_on_sigint)
        self.cp_stream: Any = None
        self.stream: Any = None  # StreamRef of cp_stream
        self._torch_stream: Any = None
        self._current = contextlib.ExitStack()  # the CuPy stream made current, until close()
        if ctx.all_have_gpus:
            self.cp_stream, self.stream = command_stream(ctx)
            # The user's call and the request take the framework's current stream, as a user's do.
            # Entered, not .use(): CuPy ends a `with stream:` block (the staging anchor's) by going
            # back to the innermost entered stream, which would drop a stream set by .use() and leave
            # the legacy stream current, unordered with this stream's fills, checks and timing.
            self._current.enter_context(self.cp_stream)
            try:
                if args.framework == "torch":
                    from mpigpu.bench.anchors import use_torch_stream

                    self._torch_stream = use_torch_stream(ctx, self.cp_stream)
            except BaseException:
                self.close()
                raise

    def use(self, args: argparse.Namespace) -> None:
        """Measure the collective of ``args`` next (``--collective`` with several: one sweep, so one
        stream and one set of anchors, an NCCL communicator and a torch process group each, for all);
        the lists of measurements start empty for it."""
        self.args, self.collective = args, getattr(args, "collective", "allreduce")
        self.stopped, self.unsupported, self.measurements, self.rechecks = [], [], [], []

    def close(self) -> None:
        """Close the anchors; CuPy gets back the stream current before the sweep, torch its default (collective)."""
        for anchor in self._anchors.values():
            anchor.close()
        self._anchors.clear()
        self._current.close()  # CuPy's current stream: the one before this sweep
        if self.cp_stream is not None:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.set_stream(torch.cuda.default_stream(self.ctx.gpu.index))
            self._torch_stream = None

    @contextlib.contextmanager
    def stop_on_sigint(self) -> Iterator[None]:
        """Ctrl-C asks the sweep to stop after the measurement under way (Interrupted, on every rank at the
        same size: the ranks agree before each one), so the command can print what it measured; a second
        Ctrl-C interrupts at once."""

        def handler(signum: int, frame: Any) -> None:
            self._sigint = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.progress("Ctrl-C: stopping after this measurement to print the results so far (again: abort now)")

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _check_interrupt(self) -> None:
        """Raise Interrupted on every rank if any rank got Ctrl-C (collective: one MPI_Allreduce)."""
        from mpigpu.core._mpi import MPI

        if self.comm.allreduce(int(self._sigint), op=MPI().MAX):
            raise Interrupted

    def _anchor(self, name: str) -> Any:
        anchor = self._anchors.get(name)
        if anchor is None:
            # an anchor of the moves is one of allreduce's with the moves added: it serves every collective
            cls = COLLECTIVE_ANCHORS.get(name) or anchor_classes(self.collective)[name]
            anchor = self._anchors[name] = cls(self.ctx, self.cp_stream if cls.placement == "device" else None)
        return anchor

    def _max(self, value: float) -> float:
        from mpigpu.core._mpi import MPI

        return float(self.comm.allreduce(float(value), op=MPI().MAX))

    def progress(self, text: str) -> None:
        if self.rank == 0 and not self.args.quiet:
            sys.stderr.write(f"[bench] {text}\n")
            sys.stderr.flush()

    def workload(self, placement: str, dtype: DType, count: int) -> Any:
        """Buffers for the largest call of a group (an output only where out of place is timed)."""
        device = placement == "device"
        if device:
            self.ctx.activate_gpu()
        if self.collective != "allreduce":
            gpu = self.ctx.gpu if device else None
            return CollectiveWorkload.allocate(
                self.collective, count, dtype, self.rank, self.ctx.size, gpu, self.cp_stream if device else None
            )
        return Workload.allocate(
            count=count, dtype=dtype, op=Op.SUM, pattern="exact", rank=self.rank, nranks=self.ctx.size,
            device=self.ctx.gpu if device else None, inplace=False not in self.args.modes,
            stream=self.stream if device else None,
        )  # fmt: skip

    def sweep_group(self, paths: list[PathSpec], placement: str, dtype: DType, ops: list[Op]) -> list[Measurement]:
        """Every path of one placement and dtype, for each op, mode and size: at each size the paths
        timed interleaved, in rounds (``mpigpu.bench.rounds``)."""
        counts = sorted({max(1, size // dtype.itemsize) for size in self.args.sizes})
        work = self.workload(placement, dtype, counts[-1])
        found = []
        try:
            for op in ops:
                mine = []
                for path in paths:
                    problem = _unsupported(self.ctx, path, dtype, op, self.collective)
                    if problem is None:
                        mine.append(path)
                    else:
                        self.unsupported.append(f"{path.label} {dtype.name} {op.value}: {problem}")
                for inplace in self.args.modes if mine else []:
                    found.extend(self._sweep_sizes(mine, work, counts, op, inplace))
        finally:
            work.free()
        return found

    def _sweep_sizes(
        self, paths: list[PathSpec], work: Any, counts: list[int], op: Op, inplace: bool
    ) -> list[Measurement]:
        """Every size of one op and mode, all ``paths`` at each; --time-limit bounds a size (all its
        paths' checks and rounds) and stops the sizes before one predicted to take longer."""
        found: list[Measurement] = []
        mode = "in-place" if inplace else "out-of-place"
        opname = op.value if self.collective == "allreduce" else self.collective
        group = f"{PLACE_LABEL[paths[0].placement]} {work.dtype.name} {opname} {mode}"
        limit = self.args.time_limit
        for i, count in enumerate(counts):
            self._check_interrupt()
            sized = work.sized(count, op=op, inplace=inplace)
            timed, seconds = self._measure_size(paths, sized, op, inplace)
            paths = [p for p in paths if any(m.path == p for m in timed)]  # a refusal ends a path's sizes
            growth = counts[i + 1] / count if i + 1 < len(counts) else 0.0
            judged = bool(limit) and 0 < i < len(counts) - 1  # not the first size: see _judge
            if judged:
                timed = self._judge(timed, sized, op, seconds, growth)
            for m in _with_best(timed):
                if m.path not in paths:  # auto's fastest backend of an earlier pass, timed in its rounds
                    self.rechecks.append(m)
                    continue
                found.append(m)
                self.measurements.append(m)
                wrong = f", {m.result.wrong} WRONG" if m.result.wrong else ""
                chosen = f" -> {m.chosen}" if m.chosen else ""
                self.progress(
                    f"{m.path.column} {group} {size_label(m.result.bytes)} ({i + 1}/{len(counts)}){chosen}: "
                    f"{m.result.median_us:.2f} us{wrong}"
                )
            if not paths:
                break
            predicted = self._predicted(timed, growth) if judged else 0.0
            if judged and (seconds > limit or predicted > limit):
                why = f"took {seconds:.3g} s" if seconds > limit else f"the next would take ~{predicted:.3g} s"
                columns = ", ".join(p.column for p in paths)
                size = size_label(count * work.dtype.itemsize)
                note = f"{group} ({columns}): stopped after {size} ({why}; --time-limit {limit:g} s)"
                self.stopped.append(note)
                self.progress(note)
                break
        return found

    def _predicted(self, timed: list[Measurement], growth: float) -> float:
        """The least the next size (``growth`` times this one) costs: every path's check, calibration
        calls and, per round, one warm-up call (where --warmup is not 0) and one timed call, scaled
        from this size's."""
        calls = CALIBRATION_CALLS + self.args.rounds * (1 + min(self.args.warmup, 1))
        return sum((m.check_seconds + (m.result.median_us or m.result.time_us) * 1e-6 * calls) * growth for m in timed)

    def _judge(self, timed: list[Measurement], work: Any, op: Op, seconds: float, growth: float) -> list[Measurement]:
        """``timed`` with check times fit to predict from (collective: every rank decides alike, on maxima).

        The first size is never judged: its checks carry the paths' set-up (communicator creation,
        kernel compilation), which does not grow with the size. But one-time set-up can land in a
        check of a later size too: a communicator connecting a new protocol, a kernel compiled for a
        new launch shape. Scaled by the growth, a few seconds of it stopped a sweep whose calls take
        microseconds. So where the checks predict a stop, each path is checked once more, and the
        faster of its two checks is the one scaled (a wrong element found by either counts)."""
        limit = self.args.time_limit
        if seconds > limit or self._predicted(timed, growth) <= limit:
            return timed
        judged = []
        for m in timed:
            again = self._check_again(m.path, work, op)
            if again is not None:
                wrong, check_seconds = again
                result = dataclasses.replace(m.result, wrong=max(m.result.wrong, wrong))
                m = dataclasses.replace(m, result=result, check_seconds=min(m.check_seconds, check_seconds))
            judged.append(m)
        return judged

    def _check_again(self, path: PathSpec, work: Any, op: Op) -> tuple[int, float] | None:
        """(wrong elements, seconds) of one more check of ``path`` (None if it refuses the call)."""
        bound = self._bind(path, work, op)
        if bound is None:
            return None
        try:
            return self._check(bound.call, work)
        finally:
            bound.close()

    def _bind(self, path: PathSpec, work: Any, op: Op) -> Any:
        """The call of ``path`` on ``work`` (a bench_calls.Bound), or None if it refuses it (noted)."""
        args, comm = self.args, self.comm
        stream = self.stream if path.placement == "device" else None
        anchor = self._anchor(path.name) if path.kind == "anchor" else None
        try:
            if self.collective == "allreduce":
                return bind_call(path, work, op, framework=args.framework, comm=comm, stream=stream, anchor=anchor)
            return bind_collective(path, work, framework=args.framework, ctx=self.ctx, stream=stream, anchor=anchor)
        except MpigpuError as exc:  # raised alike on every rank (the arguments are checked across ranks)
            self.unsupported.append(f"{path.label} {work.dtype.name} {op.value} {work.count} elements: {exc}")
            return None

    def _check(self, call: Any, work: Any) -> tuple[int, float]:
        """The check (nccl-tests' #wrong): fresh input, poisoned output, one call, every element;
        (wrong elements summed over ranks, its seconds on the slowest rank)."""
        from mpigpu.core.verify import total_wrong

        started = time.perf_counter()
        work.fill()
        work.poison()
        call()
        if self.rank == 0:
            work.corrupt(self.args.corrupt)
        wrong = total_wrong(self.comm, work.wrong())
        return wrong, self._max(time.perf_counter() - started)

    def _sync(self, placement: str) -> Callable[[], None]:
        """What waits for a call's work: the benchmark's stream on GPU buffers, nothing on the host."""
        return self.cp_stream.synchronize if placement == "device" else _nothing

    def _retimed(self, paths: list[PathSpec], work: Any, op: Op, inplace: bool) -> list[PathSpec]:
        """For each auto path, the fastest backend called the same way in an earlier pass at this
        size (after --tune, auto is swept on its own), where it is not among ``paths``: it is timed
        again in auto's rounds, so that the machine's drift cannot bias auto's ratio."""
        opname = op.value if self.collective == "allreduce" else "none"
        key = (paths[0].placement, work.dtype.name, opname, inplace, work.count * work.dtype.itemsize)
        extra: list[PathSpec] = []
        for path in paths:
            top = fastest_backends(self.measurements, path.call).get(key) if path.kind == "auto" else None
            if top is not None and top.path not in paths and top.path not in extra:
                extra.append(top.path)
        return extra

    def _measure_size(self, paths: list[PathSpec], work: Any, op: Op, inplace: bool) -> tuple[list[Measurement], float]:
        """Every path at one size: bound, verified and calibrated one after another, then timed
        interleaved in rounds (with auto's re-timed fastest backends, ``_retimed``). Returns the
        measurements in turn order (a path that refuses the call has none) and the size's seconds
        on the slowest rank (collective)."""
        from mpigpu.core.timing import max_phases_over_ranks

        started = time.perf_counter()
        sync = self._sync(paths[0].placement)
        turns: list[Turn] = []
        checks: list[tuple[int, float]] = []
        try:
            for path in [*paths, *self._retimed(paths, work, op, inplace)]:
                t0 = time.perf_counter()
                bound = self._bind(path, work, op)
                if bound is not None:
                    turns.append(Turn(path, bound, seconds=time.perf_counter() - t0))
            for turn in turns:
                t0 = time.perf_counter()
                checks.append(self._check(turn.bound.call, work))
                self._calibrate(turn, sync)
                turn.seconds += time.perf_counter() - t0
            run_rounds(turns, self.args.rounds, timing=self.args.timing, sync=sync, barrier=self.comm.Barrier)
        finally:
            for turn in turns:
                turn.bound.close()
        found = []
        for turn, check, fig in zip(turns, checks, figures(self.comm, turns) if turns else [], strict=True):
            phases = max_phases_over_ranks(self.comm, turn.last_phases) if turn.phases is not None else {}
            found.append(self._measurement(turn, work, op, inplace, check, fig, phases))
        return found, self._max(time.perf_counter() - started)

    def _calibrate(self, turn: Turn, sync: Callable[[], None]) -> None:
        """The turn's counts, the same on every rank: CALIBRATION_CALLS calls timed one by one
        (barrier, call, synchronise), the slowest rank's median, and calls enough for about
        TARGET_TURN_S (or --iters)."""
        samples = time_turn(turn.bound.call, sync, self.comm.Barrier, iters=CALIBRATION_CALLS, timing="call")
        estimate = self._max(statistics.median(samples) * 1e-6)
        turn.iters = self.args.iters or max(1, min(MAX_ITERS, int(TARGET_TURN_S / max(estimate, 1e-9))))
        turn.warmup = min(self.args.warmup, turn.iters)
        path = turn.path
        if path.kind != "anchor" and self.collective == "allreduce":  # last_phases: the backend's allreduce
            turn.phases = partial(self._phases, turn.bound.chosen or path.name)

    def _phases(self, backend: str) -> dict[str, float]:
        return self.ctx.backend(backend).last_phases

    def _measurement(
        self,
        turn: Turn,
        work: Any,
        op: Op,
        inplace: bool,
        check: tuple[int, float],
        fig: Figures,
        phases: dict[str, float],
    ) -> Measurement:
        """One path's row at one size: its check (wrong elements, seconds), figures and phases."""
        path, bound = turn.path, turn.bound
        wrong, check_seconds = check
        fields = dict(
            bytes=work.count * work.dtype.itemsize, elements=work.count, dtype=work.dtype.name, op=op.value,
            backend=path.name, ranks=self.ctx.size, time_us=fig.time_us, wrong=wrong, inplace=inplace,
            median_us=fig.median_us, spread_us=fig.spread_us, phases_us=phases, per_rank_us=fig.per_rank_us,
        )  # fmt: skip
        if self.collective == "allreduce":
            result = Result(**fields)
        else:
            result = CollectiveResult(**{**fields, "op": "none"}, collective=self.collective)
        chosen, reason = (bound.chosen, bound.reason) if path.kind == "auto" else (None, None)
        return Measurement(
            path, result, turn.iters, turn.warmup, self.args.rounds, fig.seconds, check_seconds, chosen, reason,
            rounds_us=fig.rounds_us,
        )  # fmt: skip


def _nothing() -> None:
    return None


def _with_best(timed: list[Measurement]) -> list[Measurement]:
    """``timed`` with each auto row's ``best``: the fastest verified backend called the same way,
    timed in the same rounds."""
    found = []
    for m in timed:
        top = fastest_backends(timed, m.path.call).get(m.key) if m.path.kind == "auto" else None
        found.append(m if top is None else dataclasses.replace(m, best=top.path.name, best_us=median_us(top)))
    return found
