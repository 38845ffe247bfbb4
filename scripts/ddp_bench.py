"""DDP's step over the "mpigpu" backend beside DDP over gloo and the same step with no communication.

    mpiexec -n 2 python scripts/ddp_bench.py [--rounds 15] [--steps 5] [--out bench/results/ddp-cpu-DATE.json]

An MLP of a few million parameters (``--width``) trains on CPU with SGD, four ways in one job: DDP
over the default group (mpigpu), DDP over a gloo group of the same ranks, the bare model (no
communication), and DDP over a group of this rank alone (DDP's own work per step: its bucket copies
and scaling, with calls that move nothing). Each round times ``--steps`` steps of each, in an order
that rotates by round, every rank starting together; a step's time is the slowest rank's. The
overhead of a backend in a round is its step time minus the bare step time of the same round
(paired, so a machine loaded by others weighs on both alike); the figures are medians over rounds.
``communication_s`` is the same against DDP alone (what the backend's calls add beyond DDP's own
work). The JSON holds the overheads, the step times, their ratio (the goal: mpigpu's overhead at
most 0.5x gloo's), the machine and the versions."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mpigpu
import mpigpu.torch  # registers the backend
from mpigpu.core._mpi import MPI

KINDS = ("none", "alone", "gloo", "mpigpu")


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )  # fmt: skip


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024, help="MLP width (1024: 4.2 M parameters)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="steps timed per model and round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/ddp-cpu-DATE.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    dist.init_process_group("mpigpu")
    gloo = dist.new_group(backend="gloo")
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # collective: every rank
    comm = MPI().COMM_WORLD.Dup()  # the timing's own exchanges: on neither group measured
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    models = {
        "none": _model(args.width),
        "alone": DDP(_model(args.width), process_group=alone),
        "gloo": DDP(_model(args.width), process_group=gloo),
        "mpigpu": DDP(_model(args.width), process_group=dist.group.WORLD),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    for kind in KINDS:  # warm up: DDP's first steps build its buckets; mpigpu remembers its calls
        _steps(models[kind], opts[kind], x, y, 3)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
            comm.Barrier()
            start = time.perf_counter()
            _steps(models[kind], opts[kind], x, y, args.steps)
            mine = (time.perf_counter() - start) / args.steps
            times[kind].append(comm.allreduce(mine, op=MPI().MAX))
    params = sum(p.numel() for p in models["none"].parameters())

    def paired(kind: str, base: str) -> float:
        return statistics.median(a - b for a, b in zip(times[kind], times[base], strict=True))

    overhead = {k: paired(k, "none") for k in ("gloo", "mpigpu")}
    result: dict[str, Any] = {
        "overhead_s": overhead,
        "ratio_mpigpu_to_gloo": overhead["mpigpu"] / overhead["gloo"] if overhead["gloo"] > 0 else None,
        "goal": "mpigpu's overhead at most 0.5x gloo's",
        "ddp_alone_overhead_s": paired("alone", "none"),
        "communication_s": {k: paired(k, "alone") for k in ("gloo", "mpigpu")},
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "per_round_step_s": times,
        "model": {"kind": "MLP", "width": args.width, "parameters": params, "gradient_bytes": 4 * params},
        "ranks": size,
        "batch": args.batch,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "torch_threads": args.threads,
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "processor": platform.processor() or platform.machine(),
        },
        "versions": {
            "mpigpu": mpigpu.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "mpi": MPI().Get_library_version().splitlines()[0].strip(),
        },
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": f"mpiexec -n {size} python " + " ".join(sys.argv),
    }
    comm.Free()
    dist.destroy_process_group()
    if rank == 0:
        out = args.out or Path("bench/results") / f"ddp-cpu-{datetime.now(UTC):%Y-%m-%d}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        o, bare = overhead, result["step_s"]["none"]
        print(f"step overhead over no communication: gloo {o['gloo'] * 1e3:.2f} ms, mpigpu {o['mpigpu'] * 1e3:.2f} ms "
              f"(ratio {result['ratio_mpigpu_to_gloo']:.2f}; goal <= 0.5); bare step {bare * 1e3:.2f} ms; "
              f"{params / 1e6:.1f} M parameters, {size} ranks -> {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
