"""``python -m mpigpu.info``: one screen of what mpigpu found, and what ``auto`` would choose.

The first thing to run when something is off: which MPI library mpi4py loaded and how, whether it
is CUDA-aware and which rule decided, the GPUs each rank got, the devices each process drives (its
participants, mpigpu.multi), NCCL, each backend's availability.
Works with 1 rank (no launcher) or under mpiexec.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from mpigpu.cli import Parser, header_lines, parse_command, prog, versions
from mpigpu.core.config import size_label

__all__ = ["gather_info", "main"]


def _auto_examples(ctx: Any) -> list[tuple[str, str, str]]:
    """(placement, size, choice) for a few sizes, as ``auto`` would decide them."""
    import numpy as np

    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.dtypes import DTYPES
    from mpigpu.core.errors import MpigpuError
    from mpigpu.core.ops import Op
    from mpigpu.runtime.plan import choose

    rows = []
    places = [("host", None)] + ([("gpu", ctx.gpu.index)] if ctx.gpu is not None else [])
    dtype = DTYPES["float32"]
    for place, device in places:
        for nbytes in (8, 64 << 10, 1 << 20, 64 << 20):
            count = nbytes // 4 if nbytes >= 4 else 1
            host = np.empty(0, np.float32) if device is None else None
            view = ArrayView(None, 0, (count,), dtype, device, False, "numpy", host=host)
            try:
                choice = choose(ctx, view, Op.AVG, "auto")
                text = f"{choice.backend}  ({choice.reason})"
            except MpigpuError as exc:
                text = f"none: {exc}"
            rows.append((place, size_label(nbytes), text))
    return rows


def _devices(ctx: Any) -> list[dict[str, Any]]:
    """Each rank's devices (``mpigpu.local_devices``: CUDA ordinals, or host device numbers) and the
    participant numbers its devices take in a call over several devices per process (collective)."""
    from mpigpu.core._mpi import world
    from mpigpu.multi import local_devices

    devices = local_devices(world())
    names: list[str] = []
    if ctx.gpu is not None:
        from mpigpu.job.device import _describe

        names = [ctx.gpu.name if d == ctx.gpu.index else _describe(d, ctx.gpu.visible).name for d in devices]
    rows = ctx.comm.allgather({"kind": "gpu" if ctx.gpu is not None else "host", "devices": devices, "names": names})
    first = 0
    for row in rows:  # participants are numbered rank by rank (mpigpu.multi.group)
        row["participants"] = list(range(first, first + len(row["devices"])))
        first += len(row["devices"])
    return rows


_BOARDS = {"CheckBoard": "node board (node-shared memory)", "NodeMpiBoard": "two-level board (node-shared memory, "
           "one MPI_Allgather among node leaders)", "MpiBoard": "flat board (one MPI_Allgather)"}  # fmt: skip


def _check(ctx: Any) -> dict[str, Any]:
    """How the cross-rank argument check (and a tiny host allreduce) travels, and on which ranks the board runs
    its Python path, with why (collective)."""
    from mpigpu.job.native_board import why_not

    board = None if ctx.size == 1 else ctx.check_board
    if board is None:
        return {"board": "none (one rank)" if ctx.size == 1 else "MPI_Allreduce(MAX)", "python_ranks": None}
    across = type(board).__name__ != "CheckBoard"  # the two-level and flat boards call MPI among nodes
    why = None if board.native is not None else (why_not(across) or "this board has no compiled plan")
    python = [(r, reason) for r, reason in enumerate(ctx.comm.allgather(why)) if reason is not None]
    return {"board": _BOARDS.get(type(board).__name__, type(board).__name__), "python_ranks": python}


def gather_info() -> dict[str, Any]:
    """Everything ``info`` prints, as a dict (collective)."""
    from mpigpu.core._mpi import world
    from mpigpu.runtime.context import Context

    ctx = Context.get(world())
    gpus = ctx.comm.gather(
        None if ctx.gpu is None else {
            "index": ctx.gpu.index, "name": ctx.gpu.name, "pci_bus_id": ctx.gpu.pci_bus_id,
            "visible": ctx.gpu.visible, "cuda_visible_devices": ctx.gpu.cuda_visible_devices,
        },
        root=0,
    )  # fmt: skip
    lib = ctx.mpi_lib
    return {
        "header": header_lines(ctx),
        "versions": versions(),
        "mpi": {"library": lib.name, "version": lib.version, "standard": lib.standard, "path": lib.path,
                "found_by": lib.found_by},
        "ranks": ctx.size,
        "nodes": ctx.layout.num_nodes,
        "ranks_per_node": list(ctx.layout.node_sizes),
        "virtual_nodes": ctx.layout.virtual,
        "gpus": gpus,
        "devices": _devices(ctx),
        "cuda_aware": {"aware": ctx.cuda_aware.aware, "rule": ctx.cuda_aware.rule,
                       "findings": list(ctx.cuda_aware.findings)},
        "nccl": {"available": ctx.nccl.available, "version": ctx.nccl.version, "reason": ctx.nccl.reason},
        "backends": {name: {"ok": a.ok, "reason": a.reason} for name, a in ctx.availability.items()},
        "check": _check(ctx),
        "tuning": {"file": str(ctx.settings.tune_path),
                   "applies": ctx.tuning.source if ctx.tuning else None},
        "auto": _auto_examples(ctx),
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("MPIGPU_", "CUDA_VISIBLE", "I_MPI_OFFLOAD", "MPI4PY_", "NCCL_"))},
    }  # fmt: skip


def render(info: dict[str, Any]) -> str:
    lines = list(info["header"])
    mpi = info["mpi"]
    lines.append(f"MPI library      {mpi['version']} (MPI {mpi['standard']})")
    lines.append(f"  loaded from    {mpi['path'] or '?'}  (found via {mpi['found_by']})")
    lines.append(
        f"Ranks            {info['ranks']} on {info['nodes']} node(s), per node {info['ranks_per_node']}"
        + ("  [virtual nodes: MPIGPU_NODE_SIZE]" if info["virtual_nodes"] else "")
    )
    gpus = info["gpus"] or []
    if not any(gpus):
        lines.append("GPUs             none (the NumPy path: backends cpu and host)")
    else:
        for rank, gpu in enumerate(gpus):
            if gpu:
                lines.append(
                    f"  rank {rank:3d} -> GPU {gpu['index']} {gpu['name']} [{gpu['pci_bus_id']}]"
                    f"  ({gpu['visible']} visible, CUDA_VISIBLE_DEVICES="
                    f"{gpu['cuda_visible_devices'] if gpu['cuda_visible_devices'] is not None else 'unset'})"
                )
    devices = info.get("devices") or []
    if devices:
        total = sum(len(row["devices"]) for row in devices)
        counts = sorted({len(row["devices"]) for row in devices})
        ranks = f"{len(devices)} rank{'s' if len(devices) != 1 else ''}"
        shape = f"{ranks} x {counts[0]} device{'s' if counts[0] != 1 else ''}" if len(counts) == 1 else ranks
        lines.append(
            f"Devices          {total} participant{'s' if total != 1 else ''} ({shape}) in calls over several "
            "devices per process (mpigpu.on_device, list calls; MPIGPU_DEVICES_PER_RANK)"
        )
        if len({row["kind"] for row in devices}) > 1:
            lines.append("  (some ranks drive GPUs and others host devices: such calls are refused)")
        for rank, row in enumerate(devices):
            if row["kind"] == "gpu":
                shown = ", ".join(f"GPU {d} {name}" for d, name in zip(row["devices"], row["names"], strict=True))
            else:
                shown = ", ".join(f"host device {d}" for d in row["devices"])
            numbers = row["participants"]
            which = f"participant {numbers[0]}" if len(numbers) == 1 else f"participants {numbers[0]}-{numbers[-1]}"
            lines.append(f"  rank {rank:3d} -> {shown}  ({which})")
    aware = info["cuda_aware"]
    lines.append(f"CUDA-aware MPI   {'yes' if aware['aware'] else 'no'}: decided by {aware['rule']}")
    for finding in aware["findings"]:
        lines.append(f"  checked        {finding}")
    nccl = info["nccl"]
    lines.append(f"NCCL             {nccl['version'] if nccl['available'] else 'no'} ({nccl['reason']})")
    lines.append("Backends")
    for name, state in info["backends"].items():
        lines.append(f"  {name:<11}    {'available' if state['ok'] else 'unavailable'}: {state['reason']}")
    check, where = info["check"], ""
    python = check["python_ranks"]
    if python is not None:  # a board: on which path
        on = "; ".join(f"{r}: {why}" for r, why in python[:4])
        where = f", Python path on rank(s) {on}" if python else ", compiled exchange on every rank"
    lines.append(f"Argument check   {check['board']}{where}")
    tuning = info["tuning"]
    lines.append(
        f"Tuning table     {tuning['file']}: "
        + (f"applies ({tuning['applies']})" if tuning["applies"] else "no table for this machine; rules apply")
    )
    lines.append("auto would pick (float32, avg)")
    for place, size, text in info["auto"]:
        lines.append(f"  {place:<4} {size:>8}  -> {text}")
    lines.append("Versions         " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    if info["environment"]:
        lines.append("Environment      " + " ".join(f"{k}={v}" for k, v in info["environment"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog=prog("mpigpu.info"),
        description="Show what mpigpu detected: MPI library, CUDA-awareness (and the rule that decided it), "
        "GPUs per rank, NCCL, backend availability, and what backend='auto' would choose. "
        "Run it alone or under your launcher (mpiexec -n 4 python -m mpigpu.info).",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parse_command(parser, argv)
    info = gather_info()
    from mpigpu.core._mpi import world

    if world().Get_rank() == 0:
        print(json.dumps(info, indent=2) if args.json else render(info))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
