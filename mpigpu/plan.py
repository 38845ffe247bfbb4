"""Choosing a backend per call: an explicit request is validated; ``auto`` uses the crossover table
that ``python -m mpigpu.bench --tune`` measured on a matching machine, or these rules:

GPU arrays:  ipc (one node, peer access) up to 4 MiB -> nccl -> cuda-aware MPI -> host staging.
Host arrays: cpu (MPI_Allreduce) below 32 MiB -> host (shared-memory reduce) from there on, where
             the host backend is available; cpu otherwise.

Every input to the choice (sizes, dtypes, capabilities agreed at start-up, the table broadcast from
rank 0) is identical on every rank, so ranks agree without talking.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpigpu.backends import BACKEND_NAMES, backend_class
from mpigpu.errors import BackendUnavailable, InvalidArgument

if TYPE_CHECKING:
    from mpigpu.arrays import ArrayView
    from mpigpu.context import Context
    from mpigpu.ops import Op

__all__ = ["Choice", "TuningTable", "choose", "choose_cached", "load_tuning", "machine_signature"]

# ipc was as fast as NCCL or faster through 4 MiB on 2 and 4 x H200 (bench/results, 2026-11-21)
IPC_MAX_BYTES = 4 << 20
HOST_SHM_MIN_BYTES = 32 << 20  # measured crossover with MPICH's MPI_Allreduce, 2 and 4 ranks (docs/host.md)
_DEVICE_ORDER = ("ipc", "nccl", "cuda-aware", "host")
_HOST_ORDER = ("host", "cpu")


@dataclass(frozen=True)
class Choice:
    """A backend and the reason it was chosen."""

    backend: str
    reason: str


@dataclass(frozen=True)
class TuningTable:
    """Best backend per size band, for one machine signature: ``bands[placement]`` is a list of
    (max_bytes, backend), ascending; the last band covers everything larger."""

    signature: dict[str, Any]
    bands: dict[str, list[tuple[int, str]]]
    source: str

    def lookup(self, placement: str, nbytes: int) -> str | None:
        bands = self.bands.get(placement) or []
        for max_bytes, name in bands:
            if nbytes <= max_bytes:
                return name
        return bands[-1][1] if bands else None


def machine_signature(ctx: Context) -> dict[str, Any]:
    """What a tuning table must match: GPU model and count per node, link, MPI library, ranks per node."""
    gpu = ctx.gpu
    link = "none"
    ipc = ctx.availability.get("ipc")
    if gpu is not None:
        link = "p2p" if ipc is not None and ipc.ok else "no-p2p"
    return {
        "gpu": gpu.name if gpu else "cpu",
        "ranks_per_node": ctx.layout.local_size,
        "nodes": ctx.layout.num_nodes,
        "link": link,
        "mpi": ctx.mpi_lib.name,
    }


def load_tuning(ctx: Context) -> TuningTable | None:
    """Rank 0 reads the table file and broadcasts the entry matching this machine (or None)."""
    entry = None
    if ctx.rank == 0:
        entry = _read_entry(ctx.settings.tune_path, machine_signature(ctx))
    entry = ctx.comm.bcast(entry, root=0)
    if entry is None:
        return None
    bands = {k: [(int(b), str(n)) for b, n in v] for k, v in entry["bands"].items()}
    return TuningTable(signature=entry["signature"], bands=bands, source=entry.get("source", ""))


def signature_key(signature: dict[str, Any]) -> str:
    return "|".join(f"{k}={signature[k]}" for k in sorted(signature))


def _read_entry(path: Path, signature: dict[str, Any]) -> dict[str, Any] | None:
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"mpigpu: ignoring unreadable tuning table {path}: {exc}\n")
        return None
    entry = document.get("tables", {}).get(signature_key(signature))
    if entry is not None:
        entry = dict(entry, source=str(path))
    return entry


def _usable(ctx: Context, name: str, view: ArrayView, op: Op) -> str | None:
    """None if ``name`` can take this call, else why not."""
    available = ctx.availability.get(name)
    if available is None or not available.ok:
        return available.reason if available else "unknown backend"
    cls = backend_class(name)
    if view.on_device and not cls.device_arrays:
        return "takes host (NumPy) arrays only"
    if not view.on_device and not cls.host_arrays:
        return "takes GPU arrays only"
    return cls.supports_on(ctx, view.dtype, op)


_CACHE_LIMIT = 4096


def choose_cached(ctx: Context, view: ArrayView, op: Op, requested: str) -> Choice:
    """``choose``, remembered per (placement, bytes, dtype, op, request) on the context: the
    decision depends on nothing else, and repeated calls (a training loop) then cost a lookup."""
    key = (view.device is not None, view.nbytes, view.dtype.name, op, requested)
    cache = ctx.plan_cache
    choice = cache.get(key)
    if choice is None:
        choice = choose(ctx, view, op, requested)
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = choice
    return choice


def choose(ctx: Context, view: ArrayView, op: Op, requested: str) -> Choice:
    """Resolve ``requested`` ("auto" or a backend name) for this call, or raise saying why not."""
    if requested != "auto":
        if requested not in BACKEND_NAMES:
            backend_class(requested)  # raises the "unknown backend" error
        problem = _usable(ctx, requested, view, op)
        if problem is None:
            return Choice(requested, "requested")
        available = ctx.availability[requested]
        if not available.ok:
            raise BackendUnavailable(f"backend {requested!r} is not available here: {available.reason}")
        where = "a GPU array" if view.on_device else "a host array"
        hint = "use backend='auto'"
        if not view.on_device and not backend_class(requested).host_arrays:
            hint = "move the data to the GPU first, or use backend='host' or 'cpu'"
        if view.on_device and not backend_class(requested).device_arrays:
            hint = "use backend='host', 'nccl' or 'auto' for GPU arrays"
        raise InvalidArgument(
            f"backend {requested!r} cannot reduce {where} of {view.dtype.name} with op {op.value}: {problem}; {hint}"
        )
    placement = "device" if view.on_device else "host"
    if ctx.tuning is not None:
        name = ctx.tuning.lookup(placement, view.nbytes)
        if name is not None and _usable(ctx, name, view, op) is None:
            return Choice(name, f"tuned table ({ctx.tuning.source}) for {view.nbytes} B")
    order = _DEVICE_ORDER if view.on_device else _HOST_ORDER
    skipped = []
    for name in order:
        problem = _usable(ctx, name, view, op)
        if problem is None and name == "ipc" and view.nbytes > IPC_MAX_BYTES:
            problem = f"message above {IPC_MAX_BYTES >> 20} MiB"
        if problem is None and name == "host" and not view.on_device and view.nbytes < HOST_SHM_MIN_BYTES:
            problem = f"message below {HOST_SHM_MIN_BYTES >> 20} MiB (MPI_Allreduce is faster there)"
        if problem is None:
            why = "; ".join(skipped)
            return Choice(name, f"rule: first usable of {', '.join(order)}" + (f" (skipped {why})" if why else ""))
        skipped.append(f"{name}: {problem}")
    raise BackendUnavailable(f"no backend can reduce this {placement} array: " + "; ".join(skipped))
