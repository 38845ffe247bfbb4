"""Microseconds per call of the Horovod layer (mpigpu.horovod.torch) beside mpigpu's own call (issue 36).

    mpiexec -n 2 python scripts/hvd_call_bench.py                         # torch CPU tensors, 8 B
    mpirun -n 2 python scripts/hvd_call_bench.py --device gpu --sizes 8,64K --json hvd-gpu.json

Columns, float32 torch tensors made once (CUDA tensors on each rank's GPU with --device gpu, on
torch's current stream), the calls as users write them (the default op of both: the average):

  hvd.allreduce(t)              a new tensor, ``t`` untouched (differentiable)
  hvd.allreduce_(t)             in place
  hvd.allreduce_async(t)+sync   ``hvd.synchronize(hvd.allreduce_async(t))``
  hvd.allreduce_async_(t)+sync  ``hvd.synchronize(hvd.allreduce_async_(t))``
  mpigpu.allreduce(t)           ``mpigpu.allreduce(t)`` (in place): the call the layer is measured against
  allreduce_async(t).wait()     ``mpigpu.allreduce_async(t).wait()``: what the async forms are measured against
  mpigpu.allreduce(t,out=o)     ``mpigpu.allreduce(t, out=o)``, ``o`` made once: mpigpu's out-of-place call
  mpigpu.allreduce(t.clone())   a new tensor reduced in place, as ``hvd.allreduce(t)`` returns one: the
                                out-of-place op's own cost in mpigpu (the copy), the layer's own part beside it
  allreduce_async(t.clone())    ``mpigpu.allreduce_async(t.clone()).wait()``: the same for ``hvd.allreduce_async``
  comm.Allreduce                (CPU tensors) ``comm.Allreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM)`` on the same
                                memory (a sum: MPI has no average; the floor under every column)

Timing is the project's benchmarks' (``mpigpu.bench.rounds``): per size, every column is checked once
on exact inputs (rank r's element j is ``(j + 3 r) % 8``; every element of the result compared), then
calibrated (3 calls; calls enough for ~30 ms a turn, the max over ranks), then ``--rounds`` rounds in
which each column takes one turn, round r starting at column r mod k; a turn is a warm-up, a
synchronisation, then one sample per call (barrier, clock, the call, synchronise the GPU, clock). A
column's figure is the median over rounds of the slowest rank's median. The goals (issue 36): the
Horovod forms within 5 us of ``mpigpu.allreduce(t)`` at 8 B, the async forms within 5 us of
``allreduce_async(t).wait()``; the table prints each column's difference, and the out-of-place forms'
difference from the same op in mpigpu (a new tensor each call: the layer's own part), each also as the
median of the per-round differences (robust to a machine that shifts between rounds). --json writes the machine,
versions, date and every figure. Exit status 1 if a column gave a wrong result, 2 for --device gpu
without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import statistics
import sys
from collections.abc import Callable
from typing import Any

AGAINST = {  # each Horovod column's reference column, and the goal's bound in us (issue 36)
    "hvd.allreduce(t)": "mpigpu.allreduce(t)",
    "hvd.allreduce_(t)": "mpigpu.allreduce(t)",
    "hvd.allreduce_async(t)+sync": "allreduce_async(t).wait()",
    "hvd.allreduce_async_(t)+sync": "allreduce_async(t).wait()",
}
SAME_OP = {  # the out-of-place forms beside mpigpu's call on a new tensor: what the layer itself adds
    "hvd.allreduce(t)": "mpigpu.allreduce(t.clone())",
    "hvd.allreduce_async(t)+sync": "allreduce_async(t.clone())",
}
ELSEWHERE = {  # the columns whose result is not ``t`` (left untouched)
    "hvd.allreduce(t)", "hvd.allreduce_async(t)+sync", "mpigpu.allreduce(t,out=o)", "mpigpu.allreduce(t.clone())",
    "allreduce_async(t.clone())",
}  # fmt: skip
GOAL_US = 5.0
TARGET_TURN_S = 0.03
MAX_ITERS = 1000


def _bytes(text: str) -> int:
    """A size in bytes through mpigpu's own parser (8, 4K, 1M, 1G), at least one float32."""
    from mpigpu.core.config import parse_count
    from mpigpu.core.errors import InvalidArgument

    try:
        value = parse_count(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: at least one float32 (4 B)")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{sys.executable} scripts/hvd_call_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="torch CPU or CUDA tensors")
    parser.add_argument(
        "--sizes", type=lambda t: [_bytes(s) for s in t.split(",") if s.strip()], default=[8],
        help="each rank's tensor in bytes, comma-separated (default 8; K, M suffixes)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every column in turn (default 7)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per turn (default 5)")
    parser.add_argument("--iters", type=int, default=0, help="timed calls per turn (default: ~30 ms a turn)")
    parser.add_argument("--json", help="write the machine, versions and figures as JSON to this path")
    return parser


class Columns:
    """The columns' calls on one tensor ``t`` (``count`` float32) of this rank, and their checks."""

    def __init__(self, hvd: Any, torch: Any, comm: Any, count: int, device: Any) -> None:
        import mpigpu

        self.hvd, self.torch, self.comm, self.count = hvd, torch, comm, count
        self.rank, self.n = comm.Get_rank(), comm.Get_size()
        self.t = torch.zeros(count, dtype=torch.float32, device=device)
        self.o = torch.full((count,), float("nan"), dtype=torch.float32, device=device)  # poisoned: out=o writes it
        self.returned: Any = None
        calls: dict[str, tuple[Callable[[], Any], str]] = {  # name: (call, the op it computes)
            "hvd.allreduce(t)": (lambda: hvd.allreduce(self.t), "avg"),
            "hvd.allreduce_(t)": (lambda: hvd.allreduce_(self.t), "avg"),
            "hvd.allreduce_async(t)+sync": (lambda: hvd.synchronize(hvd.allreduce_async(self.t)), "avg"),
            "hvd.allreduce_async_(t)+sync": (lambda: hvd.synchronize(hvd.allreduce_async_(self.t)), "avg"),
            "mpigpu.allreduce(t)": (lambda: mpigpu.allreduce(self.t), "avg"),
            "allreduce_async(t).wait()": (lambda: mpigpu.allreduce_async(self.t).wait(), "avg"),
            "mpigpu.allreduce(t,out=o)": (lambda: mpigpu.allreduce(self.t, out=self.o), "avg"),
            "mpigpu.allreduce(t.clone())": (lambda: mpigpu.allreduce(self.t.clone()), "avg"),
            "allreduce_async(t.clone())": (lambda: mpigpu.allreduce_async(self.t.clone()).wait(), "avg"),
        }
        if device.type == "cpu":
            from mpigpu.core._mpi import MPI

            mpi, host = MPI(), self.t.numpy()  # the tensor's memory
            calls["comm.Allreduce"] = (lambda: comm.Allreduce(mpi.IN_PLACE, host, op=mpi.SUM), "sum")
        self.calls = calls

    def _input(self, rank: int) -> Any:
        import numpy as np

        return ((np.arange(self.count) + 3 * rank) % 8).astype(np.float32)

    def check(self, name: str) -> int:
        """Wrong elements of one call of column ``name`` on exact inputs on this rank; ``t`` is zero
        again after (the timed calls keep zeros: the sums stay exact)."""
        import numpy as np

        call, op = self.calls[name]
        self.t.copy_(self.torch.from_numpy(self._input(self.rank)))
        returned = call()
        new = name in ELSEWHERE  # the others reduce t in place
        got = (returned if new else self.t).detach().cpu().numpy()
        total = np.sum([self._input(r) for r in range(self.n)], axis=0, dtype=np.float64).astype(np.float32)
        want = total / np.float32(self.n) if op == "avg" else total
        untouched = not new or np.array_equal(self.t.cpu().numpy(), self._input(self.rank))
        wrong = int(np.count_nonzero(got != want)) if got.shape == want.shape else want.size
        self.t.zero_()
        return wrong + (0 if untouched else 1)  # the forms that return a new tensor leave t as it was


def _sync(torch: Any, device: Any) -> Callable[[], None]:
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        return stream.synchronize
    return lambda: None


def measure(comm: Any, hvd: Any, torch: Any, device: Any, nbytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every column at one size: checked, calibrated, then timed interleaved in rounds (collective)."""
    from mpigpu.bench.calls import Bound, time_turn
    from mpigpu.bench.report import PathSpec
    from mpigpu.bench.rounds import Turn, figures, run_rounds
    from mpigpu.core._mpi import MPI

    columns = Columns(hvd, torch, comm, max(1, nbytes // 4), device)
    sync = _sync(torch, device)
    wrong = {name: int(comm.allreduce(columns.check(name), op=MPI().SUM)) for name in columns.calls}
    placement = "device" if device.type == "cuda" else "host"
    turns = []
    for name, (call, _) in columns.calls.items():
        turn = Turn(PathSpec(name, "anchor", placement), Bound(call, lambda: None))
        samples = time_turn(call, sync, comm.Barrier, iters=3, timing="call")
        estimate = float(comm.allreduce(statistics.median(samples) * 1e-6, op=MPI().MAX))
        turn.iters = args.iters or max(1, min(MAX_ITERS, int(TARGET_TURN_S / max(estimate, 1e-9))))
        turn.warmup = min(args.warmup, turn.iters)
        turns.append(turn)
    run_rounds(turns, args.rounds, timing="call", sync=sync, barrier=comm.Barrier)
    found = figures(comm, turns)
    return {
        "bytes": nbytes,
        "us": {t.path.name: f.median_us for t, f in zip(turns, found, strict=True)},
        "rounds_us": {t.path.name: list(f.rounds_us) for t, f in zip(turns, found, strict=True)},
        "iters": {t.path.name: t.iters for t in turns},
        "wrong": wrong,
    }


def _versions(torch: Any) -> dict[str, Any]:
    import mpi4py

    import mpigpu
    from mpigpu.core._mpi import library_info

    lib = library_info()
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL
            nccl = None
    return {"mpigpu": mpigpu.__version__, "torch": torch.__version__, "mpi4py": mpi4py.__version__,
            "mpi_library": lib.name, "mpi": lib.version, "python": platform.python_version(), "nccl": nccl,
            "cuda": torch.version.cuda}  # fmt: skip


def _table(rows: list[dict[str, Any]], device: str, ranks: int, rounds: int) -> list[str]:
    names = list(rows[0]["us"])
    lines = [
        f"# the Horovod layer per call, {device} float32 torch tensors, {ranks} ranks, {rounds} rounds interleaved "
        "(round r starting at column r mod k), median over rounds of the slowest rank, us; every column checked",
        f"{'column':>30}" + "".join(f"{r['bytes']:>11} B" for r in rows),
    ]
    for name in names:
        cells = "".join(f"{'WRONG':>13}" if r["wrong"][name] else f"{r['us'][name]:>13.1f}" for r in rows)
        lines.append(f"{name:>30}{cells}")
    for name, against in AGAINST.items():
        diffs = [r["us"][name] - r["us"][against] for r in rows]
        verdict = "met" if all(d <= GOAL_US for d in diffs) else "NOT met"
        goal = f" us (goal <= {GOAL_US:g}: {verdict}); "
        lines.append(
            f"# {name} - {against}: " + ", ".join(f"{d:+.1f}" for d in diffs) + goal + _paired(rows, name, against)
        )
    for name, same in SAME_OP.items():
        diffs = [r["us"][name] - r["us"][same] for r in rows]
        lines.append(
            f"# {name} - {same}: " + ", ".join(f"{d:+.1f}" for d in diffs) + " us (the layer's own part); "
            + _paired(rows, name, same)
        )  # fmt: skip
    return lines


def paired_us(row: dict[str, Any], name: str, against: str) -> float:
    """The median over rounds of column ``name`` minus ``against`` in the same round: the two turns are a
    few turns apart (tens of ms), so a shift of the whole machine that lasts for rounds (the async
    columns' two modes ~20 us apart on the shared 2-core machine) moves both alike."""
    return statistics.median(a - b for a, b in zip(row["rounds_us"][name], row["rounds_us"][against], strict=True))


def _paired(rows: list[dict[str, Any]], name: str, against: str) -> str:
    return "per round " + ", ".join(f"{paired_us(r, name, against):+.1f}" for r in rows) + " us"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    import mpigpu
    import mpigpu.horovod.torch as hvd
    from mpigpu.core._mpi import world

    comm = world()
    if args.device == "gpu":
        gpu = mpigpu.select_device()
        if gpu is None or not torch.cuda.is_available():
            if comm.Get_rank() == 0:
                sys.stderr.write("hvd_call_bench.py: --device gpu needs a GPU on every rank (none here)\n")
            return 2
        torch.cuda.set_device(gpu.index)
        device = torch.device("cuda", gpu.index)
    else:
        device = torch.device("cpu")
    hvd.init()
    rows = [measure(comm, hvd, torch, device, nbytes, args) for nbytes in args.sizes]
    for row in rows:  # each difference the table prints, as the median of its per-round differences
        pairs = [*AGAINST.items(), *SAME_OP.items()]
        row["paired_us"] = {f"{name} - {against}": paired_us(row, name, against) for name, against in pairs}
    bad = any(w for row in rows for w in row["wrong"].values())
    if comm.Get_rank() == 0:
        lines = _table(rows, "CUDA" if device.type == "cuda" else "CPU", comm.Get_size(), args.rounds)
        if bad:
            lines.append("# FAIL: a column gave a wrong result (WRONG above)")
        print("\n".join(lines))
        if args.json:
            doc = {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": [sys.executable, *sys.argv], "device": args.device, "ranks": comm.Get_size(),
                "hostname": socket.gethostname(), "platform": platform.platform(),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "versions": _versions(torch), "rounds": args.rounds, "ok": not bad,
                "order": "interleaved: round r starting at column r mod k", "goal_us": GOAL_US, "against": AGAINST,
                "same_op": SAME_OP, "results": rows,
            }  # fmt: skip
            with open(args.json, "w") as fh:
                json.dump(doc, fh, indent=1)
    hvd.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
