"""Choosing a backend per call: an explicit request is validated; ``auto`` uses the crossover table
that ``python -m mpigpu.bench --tune`` measured on a matching machine, or these rules:

GPU arrays:  ipc (one node, peer access) up to 4 MiB -> nccl -> cuda-aware MPI -> host staging.
Host arrays: cpu (MPI_Allreduce) below 32 MiB -> host (shared-memory reduce) from there on, where
             the host backend is available; cpu otherwise.

The order is the registry's (``mpigpu.backends._REGISTRY``), the size limits are each backend's
``auto_declines``, and a backend is tried only for the collectives it lists.

Every input to the choice (sizes, dtypes, capabilities agreed at start-up, the table broadcast from
rank 0) is identical on every rank, so ranks agree without talking.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpigpu.backends import BACKEND_NAMES, backend_class, preference
from mpigpu.errors import BackendUnavailable, InvalidArgument
from mpigpu.privatefs import read_file

if TYPE_CHECKING:
    from mpigpu.arrays import ArrayView
    from mpigpu.context import Context
    from mpigpu.ops import Op

__all__ = ["Choice", "TuningTable", "choose", "choose_cached", "load_tuning", "machine_signature"]


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
    """Rank 0 reads and validates the table file and broadcasts the entry matching this machine, or
    None; every rank then uses the same table. A table that cannot be used (unreadable, malformed,
    or one another user could have written) is ignored, with one warning from rank 0, never an
    exception on some ranks only."""
    entry = None
    if ctx.rank == 0:
        path = ctx.settings.tune_path
        try:
            entry = _read_entry(path, machine_signature(ctx))
        except Exception as exc:  # whatever went wrong, rank 0 must still reach the broadcast
            sys.stderr.write(
                f"mpigpu: ignoring the tuning table {path} ({exc}); backend='auto' uses its built-in rules. "
                "Fix or remove the file, or write a new one with python -m mpigpu.bench --tune\n"
            )
            sys.stderr.flush()
    entry = ctx.comm.bcast(entry, root=0)
    if entry is None:
        return None
    bands = {placement: [(edge, name) for edge, name in entries] for placement, entries in entry["bands"].items()}
    return TuningTable(signature=entry["signature"], bands=bands, source=entry["source"])


def signature_key(signature: dict[str, Any]) -> str:
    return "|".join(f"{k}={signature[k]}" for k in sorted(signature))


def _read_entry(path: Path, signature: dict[str, Any]) -> dict[str, Any] | None:
    """The validated entry for ``signature`` in the table at ``path`` (None if there is no table, or
    no entry for this machine), as {"signature", "bands", "source"}; raises, saying why, if the
    table cannot be used. The whole table is checked, so a broken file is noticed on any machine."""
    text = read_file(path)  # UntrustedPath for a link, or a file another user could have written
    if text is None:
        return None
    document = json.loads(text)
    if not isinstance(document, dict) or not isinstance(document.get("tables"), dict):
        raise ValueError("expected a JSON object with a 'tables' object (as mpigpu.bench --tune writes)")
    for key, candidate in document["tables"].items():
        _check_entry(key, candidate)
    entry = document["tables"].get(signature_key(signature))
    if entry is None:
        return None
    bands = {placement: [(edge, name) for edge, name in entries] for placement, entries in entry["bands"].items()}
    return {"signature": entry.get("signature", signature), "bands": bands, "source": str(path)}


def _check_entry(key: str, entry: Any) -> None:
    """Raise ValueError unless ``entry`` is a table entry that ``load_tuning`` can use as it is."""
    where = f"tables[{key!r}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not an object")
    if not isinstance(entry.get("signature", {}), dict):
        raise ValueError(f"{where}.signature is not an object")
    bands = entry.get("bands")
    if not isinstance(bands, dict):
        raise ValueError(f"{where}.bands is not an object")
    for placement, entries in bands.items():
        at = f"{where}.bands[{placement!r}]"
        if placement not in ("device", "host"):
            raise ValueError(f"{at}: the placement must be 'device' or 'host'")
        if not isinstance(entries, list):
            raise ValueError(f"{at} is not a list of [max_bytes, backend]")
        previous = -1
        for band in entries:
            ok = isinstance(band, list) and len(band) == 2
            edge, name = band if ok else (None, None)
            if not ok or type(edge) is not int or not isinstance(name, str):
                raise ValueError(f"{at}: {band!r} is not [max_bytes (an integer), backend (a name)]")
            if edge <= previous:
                raise ValueError(f"{at}: band edges must be ascending integers >= 0 ({edge} after {previous})")
            if name not in BACKEND_NAMES:
                raise ValueError(f"{at}: unknown backend {name!r} (known: {', '.join(BACKEND_NAMES)})")
            previous = edge


_REDUCTIONS = frozenset({"allreduce"})  # the collectives whose dtype/op support a backend states


def _usable(ctx: Context, name: str, view: ArrayView, op: Op, collective: str = "allreduce") -> str | None:
    """None if ``name`` can take this call, else why not."""
    available = ctx.availability.get(name)
    if available is None or not available.ok:
        return available.reason if available else "unknown backend"
    cls = backend_class(name)
    if collective not in cls.collectives:
        return f"does not implement {collective}"
    if view.on_device and not cls.device_arrays:
        return "takes host (NumPy) arrays only"
    if not view.on_device and not cls.host_arrays:
        return "takes GPU arrays only"
    if collective not in _REDUCTIONS:  # data movement: bytes, any dtype
        return None
    return cls.supports_on(ctx, view.dtype, op)


_CACHE_LIMIT = 4096


def choose_cached(ctx: Context, view: ArrayView, op: Op, requested: str, collective: str = "allreduce") -> Choice:
    """``choose``, remembered per (placement, shape, dtype, op, request, collective) on the context:
    the decision depends on nothing else (bytes follow from shape and dtype), and repeated calls (a
    training loop) then cost a lookup."""
    key = (view.device is not None, view.shape, view.dtype.name, op, requested, collective)
    cache = ctx.plan_cache
    choice = cache.get(key)
    if choice is None:
        choice = choose(ctx, view, op, requested, collective)
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = choice
    return choice


def choose(ctx: Context, view: ArrayView, op: Op, requested: str, collective: str = "allreduce") -> Choice:
    """Resolve ``requested`` ("auto" or a backend name) for this call of ``collective``, or raise
    saying why not."""
    if requested != "auto":
        if requested not in BACKEND_NAMES:
            backend_class(requested)  # raises the "unknown backend" error
        problem = _usable(ctx, requested, view, op, collective)
        if problem is None:
            return Choice(requested, "requested")
        available = ctx.availability[requested]
        if not available.ok:
            fix = ""
            if not ctx.all_have_gpus and not backend_class(requested).host_arrays:
                fix = (
                    ". It runs on GPUs only: use backend='auto', 'cpu' or 'host' for NumPy arrays; for GPU arrays, "
                    "run on GPU nodes with at most one rank per GPU (python -m mpigpu.info shows each rank's GPU)"
                )
            raise BackendUnavailable(f"backend {requested!r} is not available here: {available.reason}{fix}")
        where = "a GPU array" if view.on_device else "a host array"
        hint = "use backend='auto'"
        if not view.on_device and not backend_class(requested).host_arrays:
            hint = "move the data to the GPU first, or use backend='host' or 'cpu'"
        if view.on_device and not backend_class(requested).device_arrays:
            hint = "use backend='host', 'nccl' or 'auto' for GPU arrays"
        what = (
            f"reduce {where} of {view.dtype.name} with op {op.value}"
            if collective in _REDUCTIONS
            else (f"{collective} {where}")
        )
        raise InvalidArgument(f"backend {requested!r} cannot {what}: {problem}; {hint}")
    placement = "device" if view.on_device else "host"
    if ctx.tuning is not None:
        name = ctx.tuning.lookup(placement, view.nbytes)
        if name is not None and _usable(ctx, name, view, op, collective) is None:
            return Choice(name, f"tuned table ({ctx.tuning.source}) for {view.nbytes} B")
    order = preference(view.on_device, collective)
    skipped = []
    for name in order:
        problem = _usable(ctx, name, view, op, collective)
        if problem is None:
            problem = backend_class(name).auto_declines(view.on_device, view.nbytes)
        if problem is None:
            why = "; ".join(skipped)
            return Choice(name, f"rule: first usable of {', '.join(order)}" + (f" (skipped {why})" if why else ""))
        skipped.append(f"{name}: {problem}")
    verb = "reduce" if collective in _REDUCTIONS else collective
    raise BackendUnavailable(f"no backend can {verb} this {placement} array: " + "; ".join(skipped))
