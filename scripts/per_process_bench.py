"""Microseconds per allreduce call, several GPUs per process against one GPU per process (mpigpu.multi).

    mpirun -n 1 python scripts/per_process_bench.py --json 1x2.json      # one process drives 2 GPUs
    mpirun -n 2 python scripts/per_process_bench.py --json 2x1.json      # two processes, one GPU each
    python scripts/per_process_bench.py --merge 1x2.json 2x1.json --out gpus-per-process-h100x2-DATE.txt

The layout is detected: one process with several visible GPUs is "1xG" (G: --gpus, default 2; it sets
MPIGPU_DEVICES_PER_RANK=G before mpigpu starts), N > 1 processes are "Nx1" (MPIGPU_DEVICES_PER_RANK=1).
Every path reduces float32 with op sum, in place, on torch CUDA tensors (CuPy arrays where torch is not
installed), on the framework's current stream of each GPU:

  1xG  threads     G threads, each bound with mpigpu.on_device(k), each calling mpigpu.allreduce(t_k, "sum")
       list        one thread: mpigpu.allreduce([t_0, ..., t_G-1], "sum")
       nccl-raw    one thread: cupy.cuda.nccl, NcclCommunicator.initAll(G); groupStart, allReduce per GPU,
                   groupEnd
  Nx1  on_device   mpigpu.allreduce(t, "sum") from a thread bound with mpigpu.on_device(0) (the several-devices
                   path with one device per process)
       allreduce   mpigpu.allreduce(t, "sum"): the one-GPU call
       torch-nccl  torch.distributed.all_reduce(t) (NCCL backend, initialised from MPI: rank 0's address and a
                   free port broadcast with mpi4py)
       nccl-raw    cupy.cuda.nccl, one NcclCommunicator per process (unique id broadcast over MPI)

Timing follows the project's benchmarks (mpigpu.bench.rounds, scripts/call_cost.py): per size, rounds in
which every path takes one turn, the starting path rotating from round to round; a turn is a warm-up,
then --iters samples of one call each: a barrier (MPI_Barrier, and a barrier of the G threads), the host
clock, the call, a synchronisation of every GPU the call ran on (torch.cuda.synchronize / CuPy's
Device.synchronize), the clock. A sample of the thread path spans from the first thread leaving the
barrier to the last thread done. A turn's figure is its samples' median; a round's is the slowest
participant's (the max over ranks); a path's figure is the median over rounds. Before the rounds every
path is warmed up and checked once per size (participant p adds p + 1; the result must be the sum).
The ratio is to nccl-raw of the same layout.

--json writes the machine (nvidia-smi name, GPU count), the versions (cupy, nccl, torch, mpi4py, the MPI
library), the date, the layout and, per path and size, the median us and the ratio to nccl-raw. --merge
reads the JSON files of both layouts and prints (and with --out writes) one table: the result file
bench/results/gpus-per-process-<gpu>x2-<date>.txt. Nothing GPU-related is imported before the options are
read; without a visible GPU the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPT = "scripts/per_process_bench.py"
DEFAULT_SIZES = "8,1M,16M,256M"
LABELS = {
    "threads": "mpigpu, a thread per GPU (on_device)",
    "list": "mpigpu, list call from one thread",
    "on_device": "mpigpu, thread bound with on_device(0)",
    "allreduce": "mpigpu.allreduce(t), the one-GPU call",
    "torch-nccl": "torch.distributed.all_reduce (NCCL)",
    "nccl-raw": "raw NCCL (cupy.cuda.nccl)",
}


# -- options ------------------------------------------------------------------------------------------
def _bytes(text: str) -> int:
    """A size in bytes: 8, 64K, 1M, 256M, 1G (binary suffixes, an optional B)."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    if value and value[-1] in "KMG":
        scale = 1 << (10 * ("KMG".index(value[-1]) + 1))
        value = value[:-1]
    try:
        number = int(value) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (8, 64K, 1M, 256M)") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is at least 1 byte")
    return number


def _sizes(text: str) -> list[int]:
    sizes = [_bytes(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("empty list of sizes")
    return list(dict.fromkeys(sizes))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small: it must be >= 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python {SCRIPT}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=_sizes(DEFAULT_SIZES),
        help=f"message sizes in bytes, comma-separated, K/M/G binary (default {DEFAULT_SIZES})",
    )
    parser.add_argument("--rounds", type=_positive, default=7, help="rounds per size (default 7)")
    parser.add_argument(
        "--iters",
        type=_positive,
        default=100,
        help="timed calls per turn up to 1 MiB (default 100); fewer for larger sizes, at least 5",
    )
    parser.add_argument("--warmup", type=_positive, default=5, help="untimed calls per turn (default 5)")
    parser.add_argument("--gpus", type=_positive, default=2, help="GPUs of the one-process layout (default 2)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="merge the JSON files of the layouts into one text table (no MPI, no GPU)",
    )
    parser.add_argument("--out", type=Path, metavar="PATH", help="with --merge: also write the table here")
    return parser


def _iters(args: argparse.Namespace, nbytes: int) -> int:
    """Timed calls per turn: --iters up to 1 MiB, then fewer (each turn about as long), at least 5."""
    return max(5, min(args.iters, args.iters * (4 << 20) // max(nbytes, 1)))


def _size_label(nbytes: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


# -- arrays: torch tensors where torch has CUDA, else CuPy ------------------------------------------------
class Frame:
    """The array framework of the mpigpu paths, and what the harness needs of it per GPU."""

    def __init__(self) -> None:
        self.name = "cupy"
        try:
            import torch

            if torch.cuda.is_available():
                self.name = "torch"
        except ImportError:
            pass
        import cupy

        self.cp = cupy

    def alloc(self, device: int, count: int) -> Any:
        if self.name == "torch":
            import torch

            return torch.zeros(count, dtype=torch.float32, device=f"cuda:{device}")
        with self.cp.cuda.Device(device):
            return self.cp.zeros(count, self.cp.float32)

    def ptr(self, array: Any) -> int:
        return int(array.data_ptr()) if self.name == "torch" else int(array.data.ptr)

    def stream(self, device: int) -> int:
        """The handle of the framework's current stream on ``device`` (what mpigpu's calls use)."""
        if self.name == "torch":
            import torch

            return int(torch.cuda.current_stream(device).cuda_stream)
        with self.cp.cuda.Device(device):
            return int(self.cp.cuda.get_current_stream().ptr)

    def sync(self, device: int) -> None:
        if self.name == "torch":
            import torch

            torch.cuda.synchronize(device)
        else:
            self.cp.cuda.Device(device).synchronize()

    def use(self, device: int) -> None:
        """Make ``device`` current for the framework on the calling thread."""
        if self.name == "torch":
            import torch

            torch.cuda.set_device(device)
        self.cp.cuda.Device(device).use()

    def fill(self, array: Any, value: float) -> None:
        if self.name == "torch":
            array.fill_(value)
        else:
            with self.cp.cuda.Device(array.device.id):  # the thread may be on another GPU
                array.fill(value)

    def equals(self, array: Any, value: float) -> bool:
        if self.name == "torch":
            return bool((array == value).all().item())
        with self.cp.cuda.Device(array.device.id):
            return bool((array == value).all())


# -- paths ------------------------------------------------------------------------------------------------
class BenchPath:
    """One path: ``check(count)`` once per size, ``turn(count, warmup, iters)`` -> this rank's samples
    (us per call, one per timed call); collective where the call is."""

    name: str
    backend: str = ""

    def check(self, count: int) -> bool:
        raise NotImplementedError

    def turn(self, count: int, warmup: int, iters: int) -> list[float]:
        raise NotImplementedError

    def close(self) -> None:
        return None


def _timed_samples(
    call: Callable[[], Any], sync: Callable[[], None], barrier: Callable[[], Any], warmup: int, iters: int
) -> list[float]:
    """``warmup`` calls, then mpigpu.bench's per-call samples (barrier, clock, call, synchronize, clock)."""
    from mpigpu.bench.calls import time_turn

    for _ in range(warmup):
        call()
    sync()
    return time_turn(call, sync, barrier, iters=iters, timing="call")


class OneThread(BenchPath):
    """A path called from the main thread on every local GPU's buffer."""

    def __init__(
        self,
        name: str,
        frame: Frame,
        devices: list[int],
        buffers: list[Any],
        comm: Any,
        call: Callable[[list[Any]], Any],
    ) -> None:
        self.name, self.frame, self.devices, self.buffers, self.comm, self._call = (
            name,
            frame,
            devices,
            buffers,
            comm,
            call,
        )
        self.first = comm.Get_rank() * len(devices)

    def _views(self, count: int) -> list[Any]:
        return [b[:count] for b in self.buffers]

    def _sync(self) -> None:
        for d in self.devices:
            self.frame.sync(d)

    def check(self, count: int) -> bool:
        views = self._views(count)
        total = self.comm.Get_size() * len(self.devices)
        for k, v in enumerate(views):
            self.frame.fill(v, float(self.first + k + 1))
        self._sync()
        self._call(views)
        self._sync()
        ok = all(self.frame.equals(v, float(total * (total + 1) // 2)) for v in views)
        for v in views:
            self.frame.fill(v, 0.0)
        self._sync()
        return ok

    def turn(self, count: int, warmup: int, iters: int) -> list[float]:
        views = self._views(count)
        return _timed_samples(lambda: self._call(views), self._sync, self.comm.Barrier, warmup, iters)


class Threads(BenchPath):
    """One worker thread per local GPU, bound with mpigpu.on_device(k) for its life; a turn's sample
    spans from the first thread leaving the thread barrier to the last one done (its GPU synchronised)."""

    name = "threads"

    def __init__(self, frame: Frame, devices: list[int], buffers: list[Any], comm: Any) -> None:
        import queue
        import threading

        self.frame, self.devices, self.buffers, self.comm = frame, devices, buffers, comm
        n = len(devices)
        self.barrier = threading.Barrier(n, action=comm.Barrier)  # the ranks too, as every path's samples
        self.jobs: list[Any] = [queue.Queue() for _ in range(n)]
        self.done: Any = queue.Queue()
        self.threads = [
            threading.Thread(target=self._loop, args=(k,), daemon=True, name=f"device {k}") for k in range(n)
        ]
        for thread in self.threads:
            thread.start()

    def _loop(self, k: int) -> None:
        import mpigpu

        self.frame.use(self.devices[k])
        with mpigpu.on_device(k):
            while True:
                job = self.jobs[k].get()
                if job is None:
                    return
                try:
                    result = job(k)
                except BaseException as exc:
                    self.barrier.abort()
                    result = exc
                self.done.put((k, result))

    def _run(self, job: Callable[[int], Any]) -> list[Any]:
        for q in self.jobs:
            q.put(job)
        results: list[Any] = [None] * len(self.jobs)
        for _ in self.jobs:
            k, result = self.done.get()
            results[k] = result
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            import threading

            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return results

    def check(self, count: int) -> bool:
        import mpigpu

        total = self.comm.Get_size() * len(self.devices)
        first = self.comm.Get_rank() * len(self.devices)

        def job(k: int) -> bool:
            view = self.buffers[k][:count]
            self.frame.fill(view, float(first + k + 1))
            self.frame.sync(self.devices[k])
            mpigpu.allreduce(view, "sum")
            self.frame.sync(self.devices[k])
            ok = self.frame.equals(view, float(total * (total + 1) // 2))
            self.frame.fill(view, 0.0)
            self.frame.sync(self.devices[k])
            return ok

        return all(self._run(job))

    def turn(self, count: int, warmup: int, iters: int) -> list[float]:
        import mpigpu

        def job(k: int) -> list[tuple[float, float]]:
            view, device = self.buffers[k][:count], self.devices[k]
            for _ in range(warmup):
                mpigpu.allreduce(view, "sum")
            self.frame.sync(device)
            clock = time.perf_counter
            spans = []
            for _ in range(iters):
                self.barrier.wait()
                t0 = clock()
                mpigpu.allreduce(view, "sum")
                self.frame.sync(device)
                spans.append((t0, clock()))
            return spans

        per_thread = self._run(job)
        return [(max(s[i][1] for s in per_thread) - min(s[i][0] for s in per_thread)) * 1e6 for i in range(iters)]

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for thread in self.threads:
            thread.join(timeout=30)


class BoundOne(OneThread):
    """mpigpu.allreduce(t) from the main thread bound with on_device(0) for the turn (not per call)."""

    def check(self, count: int) -> bool:
        import mpigpu

        with mpigpu.on_device(0):
            return super().check(count)

    def turn(self, count: int, warmup: int, iters: int) -> list[float]:
        import mpigpu

        with mpigpu.on_device(0):
            return super().turn(count, warmup, iters)


class NcclRaw:
    """NCCL through cupy.cuda.nccl: one communicator per local GPU, every (rank, GPU) a participant."""

    def __init__(self, frame: Frame, devices: list[int], comm: Any) -> None:
        from cupy.cuda import nccl

        self.nccl, self.frame, self.devices = nccl, frame, devices
        size, rank = comm.Get_size(), comm.Get_rank()
        if size == 1:
            self.comms = nccl.NcclCommunicator.initAll(list(devices))
        else:
            uid = comm.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
            with frame.cp.cuda.Device(devices[0]):
                self.comms = [nccl.NcclCommunicator(size, uid, rank)]
        self.streams = [frame.stream(d) for d in devices]  # the same streams as the mpigpu paths'

    def __call__(self, views: list[Any]) -> None:
        nccl, frame = self.nccl, self.frame
        count = int(views[0].numel()) if frame.name == "torch" else int(views[0].size)
        if len(views) == 1:
            self.comms[0].allReduce(
                frame.ptr(views[0]), frame.ptr(views[0]), count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, self.streams[0]
            )
            return
        nccl.groupStart()
        try:
            for comm, view, stream in zip(self.comms, views, self.streams, strict=True):
                comm.allReduce(frame.ptr(view), frame.ptr(view), count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream)
        finally:
            nccl.groupEnd()

    def close(self) -> None:
        for comm in self.comms:
            comm.destroy()
        self.comms = []


def _torch_distributed(comm: Any, device: int) -> str | None:
    """Start torch.distributed (NCCL) from MPI: rank 0's address and a free port, broadcast (collective).
    None, or why not (the same on every rank)."""
    import socket

    problem = None
    try:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
            problem = "this torch has no torch.distributed with NCCL and CUDA"
    except ImportError:
        problem = "torch is not installed"
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        return problems[0]
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:  # a port free now; the TCP store binds it next
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        one_host = len(set(comm.allgather(socket.gethostname()))) == 1
        address = ("127.0.0.1" if one_host else socket.gethostname(), port)
    else:
        comm.allgather(socket.gethostname())
    host, port = comm.bcast(address, root=0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://{host}:{port}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
        timeout=datetime.timedelta(seconds=120),
    )
    return None


# -- the run ----------------------------------------------------------------------------------------------
def _machine() -> dict[str, Any]:
    from mpigpu.cli import gpu_names

    names = gpu_names()
    return {
        "gpu": names[0] if names else None,
        "gpu_count": len(names),
        "gpus": names,
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }


def _versions(ctx: Any, frame: Frame) -> dict[str, Any]:
    import cupy
    import mpi4py
    from cupy.cuda import nccl

    import mpigpu

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "mpigpu": mpigpu.__version__,
        "cupy": cupy.__version__,
        "mpi4py": mpi4py.__version__,
    }
    try:
        v = int(nccl.get_version())
        found["nccl"] = (
            f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"
        )
    except Exception as exc:  # the version only: the runs say whether NCCL works
        found["nccl"] = f"unknown ({type(exc).__name__})"
    try:
        import torch

        found["torch"] = torch.__version__
        if torch.cuda.is_available():
            found["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except ImportError:
        found["torch"] = None
    found["mpi_library"] = ctx.mpi_lib.version.splitlines()[0]
    found["framework"] = frame.name
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        found["mpigpu_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    return found


def _chosen(ctx: Any, path: str, array: Any) -> str:
    """The backend an mpigpu path runs on for ``array`` (auto's choice), or what the anchor is."""
    from mpigpu.core.arrays import as_view
    from mpigpu.core.ops import Op

    if path == "allreduce":
        import mpigpu

        return mpigpu.explain(array, "sum").backend
    if path in ("threads", "list", "on_device"):
        from mpigpu.multi import paths
        from mpigpu.multi.group import Group

        return paths.choose(Group.of(ctx), as_view(array), Op.SUM, "auto").backend
    return "nccl"


def run(args: argparse.Namespace) -> int:
    from mpigpu.cli import require_gpu

    require_gpu(SCRIPT, "cupy")  # one line and exit status 2 without a GPU or CuPy
    from mpigpu.core._cuda import visible_device_count
    from mpigpu.core._mpi import world

    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    visible = visible_device_count()
    if size == 1 and visible < args.gpus:
        sys.stderr.write(
            f"{SCRIPT}: one process drives {args.gpus} GPUs (layout 1x{args.gpus}), but it sees "
            f"{visible}: run on a machine with {args.gpus} GPUs, or under mpirun -n 2 (layout 2x1)\n"
        )
        return 2
    # before mpigpu meets the communicator: one process drives --gpus GPUs, several processes one each
    os.environ["MPIGPU_DEVICES_PER_RANK"] = str(args.gpus if size == 1 else 1)
    import mpigpu
    from mpigpu.runtime.context import Context

    ctx = Context.get(comm)
    devices = mpigpu.local_devices()
    layout = f"{size}x{len(devices)}"
    frame = Frame()
    frame.use(devices[0])
    largest = max(1, max(args.sizes) // 4)
    buffers = [frame.alloc(d, largest) for d in devices]
    raw = NcclRaw(frame, devices, comm)
    paths: list[BenchPath] = []
    skipped: dict[str, str] = {}
    if size == 1:
        paths.append(Threads(frame, devices, buffers, comm))
        paths.append(OneThread("list", frame, devices, buffers, comm, lambda views: mpigpu.allreduce(views, "sum")))
    else:
        paths.append(BoundOne("on_device", frame, devices, buffers, comm, lambda v: mpigpu.allreduce(v[0], "sum")))
        paths.append(OneThread("allreduce", frame, devices, buffers, comm, lambda v: mpigpu.allreduce(v[0], "sum")))
        problem = _torch_distributed(comm, devices[0]) if frame.name == "torch" else "torch is not installed"
        if problem is None:
            import torch.distributed as dist

            paths.append(OneThread("torch-nccl", frame, devices, buffers, comm, lambda v: dist.all_reduce(v[0])))
        else:
            skipped["torch-nccl"] = problem
    paths.append(OneThread("nccl-raw", frame, devices, buffers, comm, raw))
    if rank == 0:
        print(
            f"# {SCRIPT}: layout {layout} ({size} process{'es' if size != 1 else ''} x {len(devices)} GPU"
            f"{'s' if len(devices) != 1 else ''}), float32 sum in place, {frame.name} arrays, "
            f"{args.rounds} rounds per size",
            flush=True,
        )
        for name, why in skipped.items():
            print(f"# {name} skipped: {why}", flush=True)

    from mpigpu.bench.rounds import rotation

    # warm-up and check: every path once per size (NCCL communicators and mpigpu's choices made here)
    checks: dict[str, dict[int, bool]] = {p.name: {} for p in paths}
    chosen: dict[str, dict[int, str]] = {p.name: {} for p in paths}
    for nbytes in args.sizes:
        count = max(1, nbytes // 4)
        for path in paths:
            checks[path.name][nbytes] = bool(comm.allreduce(int(not path.check(count)), op=_mpi_max()) == 0)
            path.turn(count, args.warmup, 1)
            chosen[path.name][nbytes] = _chosen(ctx, path.name, buffers[0][:count])
    samples: dict[str, dict[int, list[float]]] = {p.name: {n: [] for n in args.sizes} for p in paths}
    for nbytes in args.sizes:
        count, iters = max(1, nbytes // 4), _iters(args, nbytes)
        for r in range(args.rounds):
            for i in rotation(len(paths), r):
                turn = paths[i].turn(count, args.warmup, iters)
                samples[paths[i].name][nbytes].append(statistics.median(turn))
    results: dict[str, Any] = {}
    for path in paths:
        rows = {}
        for nbytes in args.sizes:
            mine = samples[path.name][nbytes]
            per_round = [max(values) for values in zip(*comm.allgather(mine), strict=True)]  # slowest participant
            rows[str(nbytes)] = {
                "median_us": statistics.median(per_round),
                "rounds_us": per_round,
                "spread_us": max(per_round) - min(per_round),
                "checked": checks[path.name][nbytes],
                "backend": chosen[path.name][nbytes],
            }
        results[path.name] = rows
    for rows in results.values():
        for nbytes in args.sizes:
            base = results["nccl-raw"][str(nbytes)]["median_us"]
            rows[str(nbytes)]["ratio_to_nccl_raw"] = rows[str(nbytes)]["median_us"] / base if base else None
    ok = all(all(c.values()) for c in checks.values())
    machine = _machine() if rank == 0 else None
    versions = _versions(ctx, frame)
    for path in paths:
        path.close()
    raw.close()
    if "torch-nccl" in results:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank == 0:
        document = {
            "ok": ok,
            "layout": layout,
            "processes": size,
            "gpus_per_process": len(devices),
            "machine": machine,
            "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dtype": "float32",
            "op": "sum",
            "inplace": True,
            "framework": frame.name,
            "method": "per size, rounds with the starting path rotating; a turn: warm-up, then one call per sample "
            "(barrier, clock, call, synchronise every GPU, clock); turn median, slowest participant per "
            "round, median over rounds",
            "rounds": args.rounds,
            "iters": {str(n): _iters(args, n) for n in args.sizes},
            "warmup": args.warmup,
            "sizes": args.sizes,
            "paths": [p.name for p in paths],
            "labels": {p.name: LABELS[p.name] for p in paths},
            "skipped": skipped,
            "results": results,
        }
        print(_table([document]))
        print("# PASS: every path's result checked at every size" if ok else "# FAIL: a path's result was wrong")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(document, indent=2) + "\n")
    mpigpu.finalize()
    return 0 if ok else 1


def _mpi_max() -> Any:
    from mpigpu.core._mpi import MPI

    return MPI().MAX


# -- the table, and --merge -------------------------------------------------------------------------------
def _table(documents: list[dict[str, Any]]) -> str:
    """One row per layout and path: the median us per size, with the ratio to nccl-raw of its layout."""
    sizes: list[int] = []
    for doc in documents:
        sizes += [int(n) for n in doc["sizes"] if int(n) not in sizes]
    lines = [f"{'layout':<7}{'path':<42}" + "".join(f"{_size_label(n):>20}" for n in sizes)]
    for doc in documents:
        for name in doc["paths"]:
            label = doc.get("labels", {}).get(name, LABELS.get(name, name))
            cells = []
            for n in sizes:
                cell = doc["results"].get(name, {}).get(str(n))
                if cell is None:
                    cells.append(f"{'-':>20}")
                else:
                    ratio = cell.get("ratio_to_nccl_raw")
                    mark = "" if cell.get("checked", True) else " WRONG"
                    cells.append(f"{cell['median_us']:>11.1f}{f' ({ratio:.2f}x)' if ratio else '':>9}{mark}")
            lines.append(f"{doc['layout']:<7}{label:<42}" + "".join(cells))
        for name, why in doc.get("skipped", {}).items():
            lines.append(f"{doc['layout']:<7}{LABELS.get(name, name):<42}skipped: {why}")
    return "\n".join(lines)


def merge(paths: list[Path], out: Path | None) -> int:
    documents = []
    for path in paths:
        try:
            documents.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"{SCRIPT}: error: cannot read {path}: {exc}\n")
            return 2
    documents.sort(key=lambda d: (d.get("processes", 0), d.get("layout", "")))
    first = documents[0]
    machine = first.get("machine") or {}
    versions = first.get("versions") or {}
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if k != "framework" and v)
    head = [
        "# GPUs per process: allreduce, float32 sum in place, "
        + " vs ".join(
            f"{d['layout']} ({d['processes']} process{'es' if d['processes'] != 1 else ''} x "
            f"{d['gpus_per_process']} GPU{'s' if d['gpus_per_process'] != 1 else ''})"
            for d in documents
        )
        + f", {first.get('framework', '?')} arrays",
        f"# machine: {machine.get('gpu_count', '?')} x {machine.get('gpu', '?')} ({machine.get('host', '?')})",
        f"# versions: {shown}",
        "# dates: " + ", ".join(f"{d['layout']} {d.get('date', '?')}" for d in documents),
        f"# us per call: {first.get('method', '')}; ({first.get('rounds', '?')} rounds); "
        "(N.NNx): the ratio to raw NCCL of the same layout",
    ]
    if not all(d.get("ok", False) for d in documents):
        head.append("# WARNING: a run's results were not all right (see WRONG)")
    text = "\n".join(head) + "\n" + _table(documents) + "\n"
    sys.stdout.write(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.out is not None:
        _parser().error("--out goes with --merge")
    from mpigpu.job.failsafe import abort_on_exception

    abort_on_exception()  # one rank's failure ends the job with its message
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
