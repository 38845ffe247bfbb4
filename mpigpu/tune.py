"""Crossover tables: from a benchmark's measurements, the fastest mpigpu backend per size band for
each placement (GPU buffers, host arrays), written under this machine's signature into the file
that ``backend="auto"`` reads (``mpigpu.plan.load_tuning``). Entries of other machines in the same
file are kept.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpigpu.config import size_label
from mpigpu.errors import ConfigError
from mpigpu.plan import load_tuning, machine_signature, signature_key
from mpigpu.privatefs import UntrustedPath, read_file, write_file

if TYPE_CHECKING:
    from mpigpu.context import Context
    from mpigpu.plan import TuningTable

__all__ = [
    "HYSTERESIS",
    "Sample",
    "bands_from_samples",
    "best_per_size",
    "describe_bands",
    "install",
    "size_label",
    "write_entry",
]

# A size keeps the previous size's winner when that one is within this fraction of the best: fewer,
# wider bands, and noise does not flip the choice back and forth.
HYSTERESIS = 0.02

Bands = dict[str, list[tuple[int, str]]]


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


def install(ctx: Context, bands: Bands, meta: dict[str, Any]) -> TuningTable | None:
    """Write ``bands`` for this machine (rank 0) and make ``ctx`` use the new table (collective).

    A failure to write is raised on every rank."""
    error = None
    if ctx.rank == 0:
        try:
            write_entry(ctx.settings.tune_path, machine_signature(ctx), bands, meta)
        except ConfigError as exc:
            error = str(exc)
    error = ctx.comm.bcast(error, root=0)
    if error is not None:
        raise ConfigError(error)
    ctx.tuning = load_tuning(ctx)
    ctx.plan_cache.clear()  # choices remembered under the old table
    return ctx.tuning
