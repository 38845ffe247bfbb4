"""Crossover tables: from a benchmark's measurements, the fastest mpigpu backend per size band for
each placement (GPU buffers, host arrays), written under this machine's signature into the file
that ``backend="auto"`` reads (``load_tuning``, here too). Entries of other machines in the same
file are kept.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mpigpu.backends import BACKEND_NAMES
from mpigpu.core.config import size_label
from mpigpu.core.errors import ConfigError
from mpigpu.core.privatefs import UntrustedPath, read_file, write_file
from mpigpu.core.typed import bcast_text

if TYPE_CHECKING:
    from mpigpu.backends import Availability
    from mpigpu.core._mpi import LibraryInfo
    from mpigpu.core.config import Settings
    from mpigpu.job.device import GpuInfo
    from mpigpu.job.topology import Layout

__all__ = [
    "HYSTERESIS",
    "Sample",
    "TuningContext",
    "TuningTable",
    "bands_from_samples",
    "best_per_size",
    "describe_bands",
    "install",
    "load_tuning",
    "machine_signature",
    "signature_key",
    "size_label",
    "write_entry",
]

# A size keeps the previous size's winner when that one is within this fraction of the best: fewer,
# wider bands, and noise does not flip the choice back and forth.
HYSTERESIS = 0.02

Bands = dict[str, list[tuple[int, str]]]


class TuningContext(Protocol):
    """What the table reads and sets on the communicator's context (mpigpu.runtime.context.Context)."""

    rank: int
    comm: Any
    settings: Settings
    gpu: GpuInfo | None
    layout: Layout
    mpi_lib: LibraryInfo
    availability: dict[str, Availability]
    tuning: TuningTable | None
    plan_cache: dict[tuple[Any, ...], Any]


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


def machine_signature(ctx: TuningContext) -> dict[str, Any]:
    """What a tuning table must match: GPU model and count per node, link, MPI library, and the layout
    (nodes, ranks per node; each node's ranks where they differ, "2+1"): the crossovers move with
    the layout (mpigpu.runtime.plan.layout_rule), so a table measured in one layout serves that one."""
    gpu = ctx.gpu
    link = "none"
    ipc = ctx.availability.get("ipc")
    if gpu is not None:
        link = "p2p" if ipc is not None and ipc.ok else "no-p2p"
    sizes = ctx.layout.node_sizes
    signature = {
        "gpu": gpu.name if gpu else "cpu",
        "ranks_per_node": max(sizes),  # the same on every rank (its own node's size is not, at 2+1)
        "nodes": ctx.layout.num_nodes,
        "link": link,
        "mpi": ctx.mpi_lib.name,
    }
    if len(set(sizes)) > 1:  # uneven: ranks_per_node alone would match an even layout's table
        signature["node_sizes"] = "+".join(map(str, sizes))
    return signature


def load_tuning(ctx: TuningContext) -> TuningTable | None:
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
    text = bcast_text(ctx.comm, None if entry is None else json.dumps(entry), root=0)
    if text is None:
        return None
    entry = json.loads(text)
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


@dataclass(frozen=True)
class Sample:
    """One verified measurement of an mpigpu backend."""

    placement: str  # "device" or "host"
    nbytes: int
    backend: str
    median_us: float
    group: tuple[str, str, bool]  # (dtype, op, in place): sizes are compared within a group
    ok: bool = True  # no wrong element


def best_per_size(samples: Iterable[Sample]) -> dict[str, list[tuple[int, str]]]:
    """For each placement, (size, winner) ascending.

    At each size, a backend competes only if it was measured, and right, in every group measured
    at that size; its score is its mean time relative to the group's fastest."""
    table: dict[tuple[str, int], dict[tuple[str, str, bool], dict[str, Sample]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for sample in samples:
        table[(sample.placement, sample.nbytes)][sample.group][sample.backend] = sample
    result: dict[str, list[tuple[int, str]]] = defaultdict(list)
    previous: dict[str, str] = {}
    for placement, nbytes in sorted(table):
        groups = table[(placement, nbytes)]
        names = set.intersection(*(set(g) for g in groups.values()))
        scores = {}
        for name in names:
            if not all(g[name].ok for g in groups.values()):
                continue
            ratios = []
            for g in groups.values():
                fastest = min(s.median_us for s in g.values() if s.ok)
                ratios.append(g[name].median_us / fastest if fastest > 0 else 1.0)
            scores[name] = sum(ratios) / len(ratios)
        if not scores:
            continue
        winner = min(sorted(scores), key=lambda n: scores[n])
        kept = previous.get(placement)
        if kept in scores and scores[kept] <= scores[winner] * (1 + HYSTERESIS):
            winner = kept
        previous[placement] = winner
        result[placement].append((nbytes, winner))
    return dict(result)


def bands_from_samples(samples: Iterable[Sample]) -> Bands:
    """Merge adjacent sizes with the same winner into bands of (max_bytes, backend).

    A band ends halfway (geometrically) between its largest size and the next band's smallest;
    the last band covers everything larger."""
    bands: Bands = {}
    for placement, winners in best_per_size(samples).items():
        merged: list[tuple[int, str]] = []
        for i, (nbytes, name) in enumerate(winners):
            following = winners[i + 1] if i + 1 < len(winners) else None
            if following is not None and following[1] == name:
                continue
            edge = nbytes if following is None else int(math.sqrt(nbytes * following[0]))
            merged.append((edge, name))
        bands[placement] = merged
    return bands


def describe_bands(bands: Bands) -> list[str]:
    """One readable line per placement: ``device: <= 192 KiB ipc | <= 64 MiB nccl | larger host``."""
    lines = []
    for placement in sorted(bands):
        entries = bands[placement]
        parts = [f"<= {size_label(edge)} {name}" for edge, name in entries[:-1]]
        if entries:
            parts.append(f"{'larger' if parts else 'all sizes'} {entries[-1][1]}")
        lines.append(f"{placement}: " + " | ".join(parts))
    return lines


def write_entry(path: Path, signature: dict[str, Any], bands: Bands, meta: dict[str, Any]) -> dict[str, Any]:
    """Store ``bands`` under ``signature`` in the table file at ``path`` and return the entry.

    Other machines' entries stay; for this machine, placements not measured now keep their old
    bands. The file is replaced atomically, so a reader never sees half of it, and neither a link at
    ``path`` nor one at the temporary name is followed. An existing table that another user could
    have written is not merged: ConfigError."""
    document: dict[str, Any] = {"tables": {}}
    try:
        text = read_file(path)
        if text is not None:
            document = json.loads(text)
            if not isinstance(document, dict) or not isinstance(document.get("tables"), dict):
                raise ValueError("no 'tables' object")
    except UntrustedPath as exc:
        raise ConfigError(
            f"the tuning table {path} is not used: {exc}; remove it or set MPIGPU_TUNE_FILE to a path of your own"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"the tuning table {path} exists but cannot be read ({exc}); move it away or set MPIGPU_TUNE_FILE "
            "to another path"
        ) from exc
    key = signature_key(signature)
    old = document["tables"].get(key) or {}
    merged = dict(old.get("bands") or {})
    merged.update({placement: [[edge, name] for edge, name in entries] for placement, entries in bands.items()})
    entry = dict(meta, signature=signature, bands=merged)
    document["tables"][key] = entry
    try:
        write_file(path, (json.dumps(document, indent=2) + "\n").encode())
    except OSError as exc:
        raise ConfigError(
            f"cannot write the tuning table to {path} ({exc}); set MPIGPU_TUNE_FILE to a writable path"
        ) from exc
    return entry


def install(ctx: TuningContext, bands: Bands, meta: dict[str, Any]) -> TuningTable | None:
    """Write ``bands`` for this machine (rank 0) and make ``ctx`` use the new table (collective).

    A failure to write is raised on every rank."""
    error = None
    if ctx.rank == 0:
        try:
            write_entry(ctx.settings.tune_path, machine_signature(ctx), bands, meta)
        except ConfigError as exc:
            error = str(exc)
    error = bcast_text(ctx.comm, error, root=0)
    if error is not None:
        raise ConfigError(error)
    ctx.tuning = load_tuning(ctx)
    ctx.plan_cache.clear()  # choices remembered under the old table
    return ctx.tuning
