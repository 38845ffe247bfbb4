"""The report of ``python -m mpigpu.bench``: the records of a run (``PathSpec``, ``Measurement``),
the table per path, the side-by-side table of the user's call, the persistent request and the
anchors, the closing summary (auto against the fastest backend, failures, PASS/FAIL), and what is
drawn from a JSON run alone (``--plot``, ``--replot``, ``--compare``).

No MPI here: everything works on measurements or on the JSON document, so it is tested without a
launcher and ``--compare``/``--replot`` run on a laptop.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpigpu.bench.anchors import ANCHORS
from mpigpu.bench.coll_anchors import COLLECTIVE_ANCHORS
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.timing import Result
from mpigpu.runtime.tuning import size_label

__all__ = [
    "ALLREDUCE_CALLS",
    "AUTO_TARGET",
    "CALLS",
    "CALL_DESCRIPTION",
    "PLACE_LABEL",
    "Measurement",
    "PathSpec",
    "auto_summary",
    "call_description",
    "column_name",
    "compare",
    "failures",
    "fastest_backends",
    "load_run",
    "median_us",
    "plot",
    "render_tables",
    "side_by_side",
    "summary_lines",
    "what",
]

AUTO_TARGET = 1.05  # the target: auto within 5% of the fastest backend
PLACE_LABEL = {"device": "gpu", "host": "host"}

# How an mpigpu path is called (anchors have none). The column of a row is its path's name plus the suffix.
CALLS = ("user", "persistent", "prepared", "out")
ALLREDUCE_CALLS = ("user", "persistent", "prepared")  # "out": allgather and alltoall into an output made once
CALL_SUFFIX = {"user": "", "persistent": ":req", "prepared": ":prep", "out": ":out"}
CALL_DESCRIPTION = {
    "user": "mpigpu.allreduce(x) as users call it: checked across ranks every call (validated on its first)",
    "persistent": "req() of req = mpigpu.allreduce_init(x, ...) made once per size: checked once, then launched",
    "prepared": "diagnostic: mpigpu.calls.reduce.run of a call prepared once (no per-call validation or check)",
}


def what(result: Any) -> str:
    """The reduction of an allreduce row (sum, avg, ...), or the collective of a broadcast/allgather row."""
    return getattr(result, "collective", None) or result.op


def call_description(call: str, collective: str = "allreduce") -> str:
    """What a call of ``collective`` times (the collectives besides allreduce have the user's call only)."""
    if collective == "allreduce":
        return CALL_DESCRIPTION[call]
    args = {"broadcast": "x, root=0", "reduce_scatter": 'x, "sum", out=o', "alltoall": "x"}.get(collective, "x")
    if call == "out":
        args += ", out=o"
    made = " (o made once)" if "out=" in args else ""
    return (
        f"mpigpu.{collective}({args}) as users call it{made}: arguments validated and checked across ranks every call"
    )


def _description(anchor: str, collective: str) -> str:
    anchors = ANCHORS if collective == "allreduce" else COLLECTIVE_ANCHORS
    return anchors[anchor].description if anchor in anchors else ""


def column_name(path: str, call: str | None) -> str:
    """``nccl``, ``nccl:req``, ``nccl:prep``; an anchor's name as it is."""
    return path + CALL_SUFFIX.get(call or "", "")


# -- the records ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PathSpec:
    """One thing to time: an mpigpu backend or auto, called one way (``call``), or an anchor; on
    GPU buffers or host arrays."""

    name: str
    kind: str  # "backend", "anchor" or "auto"
    placement: str  # "device" or "host"
    anchor: str | None = None  # backends: the anchor reported beside it
    call: str | None = None  # backends and auto: one of CALLS (default "user"); anchors: None

    def __post_init__(self) -> None:
        if self.kind == "anchor":
            object.__setattr__(self, "call", None)
        elif self.call is None:
            object.__setattr__(self, "call", "user")
        elif self.call not in CALLS:
            raise ValueError(f"unknown call {self.call!r}: use {', '.join(CALLS)}")

    @property
    def column(self) -> str:
        return column_name(self.name, self.call)

    @property
    def label(self) -> str:
        return f"{self.column} ({PLACE_LABEL[self.placement]})"


@dataclass(frozen=True)
class Measurement:
    """One path at one size: the Result plus how it was obtained."""

    path: PathSpec
    result: Result
    iters: int  # timed calls per round
    warmup: int  # untimed calls before them, per round
    repeats: int  # rounds (the paths of a size are timed interleaved: mpigpu.bench.rounds)
    seconds: float  # wall time spent on this path at this size, slowest rank
    check_seconds: float  # of which filling, the checked call and verifying every element
    chosen: str | None = None  # auto: the backend it picked
    reason: str | None = None  # auto: why
    best: str | None = None  # auto: the fastest backend of the sweep at this size, called the same way...
    best_us: float | None = None  # ...timed (median) in the same rounds as auto, so drift cannot bias the ratio
    rounds_us: tuple[float, ...] = ()  # each round's time per call on the slowest rank (median_us: their median)

    @property
    def key(self) -> tuple[str, str, str, bool, int]:
        r = self.result
        return (self.path.placement, r.dtype, r.op, r.inplace, r.bytes)

    def to_dict(self) -> dict[str, Any]:
        data = self.result.to_dict()
        data.update(
            path=self.path.name, kind=self.path.kind, call=self.path.call, column=self.path.column,
            placement=self.path.placement, anchor=self.path.anchor, iters=self.iters, warmup=self.warmup,
            repeats=self.repeats, rounds=self.repeats, rounds_us=list(self.rounds_us), seconds=round(self.seconds, 4),
            check_seconds=round(self.check_seconds, 4),
            chosen=self.chosen, chosen_reason=self.reason, best=self.best, best_us=self.best_us,
            ok=self.result.wrong == 0,
        )  # fmt: skip
        return data


# -- tables -------------------------------------------------------------------------------------
_COLUMNS = (
    f"#{'size':>12} {'count':>11} {'type':>9} {'redop':>5} {'place':>5} {'time(us)':>10} {'median':>10} "
    f"{'spread':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>6}"
)
_BACKEND_COLUMNS = f" {'anchor(us)':>10} {'speedup':>7}"
_AUTO_COLUMNS = f" {'chosen':>10} {'best':>10} {'best(us)':>10} {'auto/best':>9}"


def _row(m: Measurement) -> str:
    r = m.result
    wrong = "N/A" if r.wrong < 0 else str(r.wrong)
    return (
        f" {r.bytes:>12} {r.elements:>11} {r.dtype:>9} {r.op:>5} {'in' if r.inplace else 'out':>5} "
        f"{r.time_us:>10.2f} {r.median_us or 0:>10.2f} {r.spread_us or 0:>9.2f} {r.algbw_gbps:>8.3f} "
        f"{r.busbw_gbps:>8.3f} {wrong:>6}"
    )


def median_us(m: Measurement | None) -> float | None:
    """The figure paths are compared by: the median over repetitions (the mean where there is none)."""
    return None if m is None else (m.result.median_us or m.result.time_us)


def fastest_backends(measurements: Iterable[Measurement], call: str | None = None) -> dict[tuple, Measurement]:
    """Per key (placement, dtype, op, mode, bytes): the fastest verified mpigpu backend (median),
    among the rows called as ``call`` (all rows when None)."""
    best: dict[tuple, Measurement] = {}
    for m in measurements:
        if m.path.kind == "backend" and m.result.wrong == 0 and call in (None, m.path.call):
            old = best.get(m.key)
            if old is None or (median_us(m) or 0) < (median_us(old) or 0):
                best[m.key] = m
    return best


def render_tables(found: list[Measurement], everything: list[Measurement]) -> list[str]:
    """One table per path for one group of measurements, anchors and fastest backends from ``everything``."""
    by_key = {(m.path.name, *m.key): m for m in everything}
    lines: list[str] = []
    order: dict[tuple[PathSpec, str, str], list[Measurement]] = {}
    for m in found:
        order.setdefault((m.path, m.result.dtype, what(m.result)), []).append(m)
    for (path, dtype, op), rows in order.items():
        rows.sort(key=lambda m: (m.result.bytes, m.result.inplace))
        collective = getattr(rows[0].result, "collective", "allreduce")
        title = f"# {path.column}  [{'GPU buffers' if path.placement == 'device' else 'host arrays'}, {dtype}, {op}]"
        columns = _COLUMNS
        if path.kind == "backend":
            anchor = path.anchor or "none"
            described = _description(anchor, collective)
            title += f"  anchor: {anchor}" + (f" ({described})" if described else "")
            columns += _BACKEND_COLUMNS
        elif path.kind == "anchor":
            title += f"  {_description(path.name, collective)}"
        else:
            columns += _AUTO_COLUMNS
        lines += ["#", title]
        if path.call is not None:
            lines.append(f"#   {path.call}: {call_description(path.call, collective)}")
        lines.append(columns)
        for m in rows:
            line = _row(m)
            if path.kind == "backend":
                anchor_us = median_us(by_key.get((path.anchor, *m.key))) if path.anchor else None
                anchor_text = f"{anchor_us:.2f}" if anchor_us else "n/a"
                ratio = f"{anchor_us / median_us(m):.2f}" if anchor_us and median_us(m) else "n/a"
                line += f" {anchor_text:>10} {ratio:>7}"
            elif path.kind == "auto":
                top_us = f"{m.best_us:.2f}" if m.best_us else "n/a"
                ratio = f"{(median_us(m) or 0) / m.best_us:.3f}" if m.best_us else "n/a"
                line += f" {m.chosen or '':>10} {m.best or 'n/a':>10} {top_us:>10} {ratio:>9}"
            lines.append(line)
        if path.kind == "auto":
            previous = None
            for m in rows:
                if m.chosen != previous:
                    lines.append(f"# auto from {size_label(m.result.bytes)}: {m.chosen} ({m.reason})")
                    previous = m.chosen
        busbw = [m.result.busbw_gbps for m in rows if m.result.busbw_gbps > 0]
        if busbw:
            lines.append(f"# avg busbw {sum(busbw) / len(busbw):.4g} GB/s")
    return lines


def side_by_side(measurements: list[Measurement], timing: str = "") -> list[str]:
    """One table per placement, dtype, op and mode: a row per size, a column per path and call
    (the user's call, the persistent request, the prepared call where timed, each anchor), each
    cell the median time per call in us, as nccl-tests sets in-place beside out-of-place. The
    columns of a row were timed interleaved, in rounds (the title says how many)."""
    groups: dict[tuple[str, str, str, bool], dict[int, dict[str, float | None]]] = {}
    columns: dict[tuple[str, str, str, bool], list[str]] = {}
    rounds: dict[tuple[str, str, str, bool], int] = {}
    for m in measurements:
        group = (m.path.placement, m.result.dtype, what(m.result), m.result.inplace)
        rounds.setdefault(group, m.repeats)
        names = columns.setdefault(group, [])
        if m.path.column not in names:
            names.append(m.path.column)
        groups.setdefault(group, {}).setdefault(m.result.bytes, {})[m.path.column] = (
            median_us(m) if m.result.wrong == 0 else None
        )
    lines: list[str] = []
    for group, rows in groups.items():
        names = _ordered(columns[group])
        width = [max(10, len(name) + 1) for name in names]
        how = f", timing {timing}" if timing else ""
        lines += [
            "#",
            f"# side by side [{_group_label(group)}]: median us per call of {rounds[group]} interleaved rounds, "
            f"slowest rank{how}; WRONG = failed the check",
            f"#{'size':>12} {'bytes':>11}" + "".join(f" {name:>{w}}" for name, w in zip(names, width, strict=True)),
        ]
        for nbytes in sorted(rows):
            cells = []
            for name, w in zip(names, width, strict=True):
                if name not in rows[nbytes]:
                    text = "-"
                else:
                    value = rows[nbytes][name]
                    text = "WRONG" if value is None else f"{value:.2f}"
                cells.append(f" {text:>{w}}")
            lines.append(f" {size_label(nbytes):>12} {nbytes:>11}" + "".join(cells))
    return lines


def _ordered(columns: Iterable[str]) -> list[str]:
    """auto's columns first, then every backend's user call, every persistent request, every
    prepared call (backends in the order given), then the anchors."""
    first = list(dict.fromkeys(columns))

    def order(column: str) -> tuple[int, int, int]:
        name, _, suffix = column.partition(":")
        call = {"": 0, "out": 1, "req": 1, "prep": 2}.get(suffix, 3)
        kind = 0 if name == "auto" else 2 if name in ANCHORS else 1
        return (kind, call, first.index(column))

    return sorted(first, key=order)


# -- the summary ----------------------------------------------------------------------------------
def auto_summary(measurements: list[Measurement]) -> dict[str, Any] | None:
    """auto's median against the fastest backend's, re-timed beside it, at every size both ran."""
    rows = [((median_us(m) or 0) / m.best_us, m) for m in measurements if m.path.kind == "auto" and m.best_us]
    if not rows:
        return None
    ratio, worst = max(rows, key=lambda row: row[0])
    r = worst.result
    return {
        "target": AUTO_TARGET,
        "sizes": len(rows),
        "within_target": sum(1 for row in rows if row[0] <= AUTO_TARGET),
        "worst_ratio": round(ratio, 4),
        "worst": {"bytes": r.bytes, "dtype": r.dtype, "op": what(r), "inplace": r.inplace, "call": worst.path.call,
                  "placement": worst.path.placement, "chosen": worst.chosen, "fastest": worst.best},
    }  # fmt: skip


def failures(measurements: Iterable[Measurement]) -> list[Measurement]:
    """The measurements with a wrong element."""
    return [m for m in measurements if m.result.wrong > 0]


def summary_lines(
    checked: list[Measurement], auto: dict[str, Any] | None, not_timed: list[str], stopped: list[str], nranks: int
) -> list[str]:
    """The lines after the tables: what was not timed or stopped early, auto against the fastest
    backend, every failure, and the verdict over ``checked`` (every verified measurement)."""
    tail = ["#"]
    tail += [f"# not timed: {line}" for line in not_timed]
    tail += [f"# {line}" for line in stopped]
    if auto:
        w = auto["worst"]
        tail.append(
            f"# auto vs the fastest mpigpu backend called the same way (median): within {AUTO_TARGET - 1:.0%} at "
            f"{auto['within_target']}/{auto['sizes']} sizes; worst {auto['worst_ratio']:.3f}x at "
            f"{size_label(w['bytes'])} {w['dtype']} {w['op']} {'in-place' if w['inplace'] else 'out-of-place'} "
            f"({PLACE_LABEL[w['placement']]}, {w.get('call') or 'prepared'} call: chose {w['chosen']}, "
            f"fastest {w['fastest']})"
        )
    failed = failures(checked)
    for m in failed:
        r = m.result
        tail.append(
            f"# FAIL: {m.path.label} {r.dtype} {what(r)} {'in-place' if r.inplace else 'out-of-place'} "
            f"{size_label(r.bytes)}: {r.wrong} wrong element{'s' if r.wrong != 1 else ''}"
        )
    wrong = sum(m.result.wrong for m in failed)
    tail.append(
        f"# {'PASS' if not failed else 'FAIL'}: {wrong} wrong elements in {len(checked)} checked measurements "
        f"over {nranks} rank{'s' if nranks != 1 else ''}"
    )
    return tail


# -- plot and compare (from the JSON document) --------------------------------------------------
def _title(doc: dict[str, Any]) -> str:
    machine, ver = doc.get("machine") or {}, doc.get("versions") or {}
    gpus = f"{machine['gpu_count']} x {machine['gpu_model']}" if machine.get("gpu_model") else "no GPU (CPU only)"
    return (
        f"mpigpu {doc.get('collective', 'allreduce')} on {machine.get('hostname', '?')}: {doc.get('ranks')} ranks, "
        f"{gpus}, "
        f"{ver.get('mpi_library', 'MPI')} ({str(doc.get('date', ''))[:10]})"
    )


def _group_label(group: tuple[str, str, str, bool]) -> str:
    placement, dtype, op, inplace = group
    where = "GPU buffers" if placement == "device" else "host arrays"
    return f"{where}, {dtype} {op}, {'in-place' if inplace else 'out-of-place'}"


def _row_call(row: dict[str, Any]) -> str | None:
    """A JSON row's call; rows written before calls were recorded were prepared calls."""
    if "call" in row:
        return row["call"]
    return None if row["kind"] == "anchor" else "prepared"


def _group_of(row: dict[str, Any]) -> tuple[str, str, str, bool]:
    return (row["placement"], row["dtype"], row.get("collective") or row["op"], row["inplace"])


def _row_column(row: dict[str, Any]) -> str:
    return column_name(row["path"], _row_call(row))


def plot(doc: dict[str, Any], path: Path) -> None:
    """busbw and time against size (log axes), one line per path and call and per anchor, one row
    of plots per group. A backend's calls share its colour: user solid, persistent dash-dot,
    prepared dotted; an anchor is dashed, in the colour of its first backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows = doc["results"]
    groups = list(dict.fromkeys(_group_of(r) for r in rows))
    names = _ordered(_row_column(r) for r in rows)
    colour: dict[str, int] = {}
    for r in rows:  # one colour per backend; an anchor takes the colour of its first backend
        if r["kind"] != "anchor":
            colour.setdefault(r["path"], len(colour))
    for r in rows:
        if r["kind"] == "backend" and r.get("anchor") and r["anchor"] not in colour:
            colour[r["anchor"]] = colour[r["path"]]
    for r in rows:
        colour.setdefault(r["path"], len(set(colour.values())))
    colours = plt.get_cmap("tab10")
    styles = {"user": ("-", "o"), "persistent": ("-.", "^"), "prepared": (":", "v"), None: ("--", "s")}
    use_busbw = (doc.get("ranks") or 1) > 1
    fig, axes = plt.subplots(len(groups), 2, figsize=(14, 4.6 * len(groups)), squeeze=False)
    sizes = FuncFormatter(lambda value, _: size_label(int(value)) if value >= 1 else "")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for (left, right), group in zip(axes, groups, strict=True):
        for name in names:
            points = sorted(
                (r for r in rows if _row_column(r) == name and _group_of(r) == group),
                key=lambda r: r["bytes"],
            )
            if not points:
                continue
            kind, call = points[0]["kind"], _row_call(points[0])
            line, marker = styles.get(call, ("-", "o"))
            label = name + (" (anchor)" if kind == "anchor" else "")
            style = {
                "linestyle": line,
                "marker": marker,
                "markersize": 3,
                "color": colours(colour[points[0]["path"]] % 10),
            }
            x = [r["bytes"] for r in points]
            bw = [r["busbw_gbps"] if use_busbw else r["algbw_gbps"] for r in points]
            left.plot(*zip(*[(a, b) for a, b in zip(x, bw, strict=True) if b > 0], strict=True), label=label, **style)
            right.plot(x, [r["median_us"] or r["time_us"] for r in points], label=label, **style)
        bw_label = "busbw (GB/s)" if use_busbw else "algbw (GB/s)"
        for ax, ylabel in ((left, bw_label), (right, "time per call, median (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(sizes)
            ax.yaxis.set_major_formatter(plain)
            low, high = ax.get_ylim()
            ax.yaxis.set_minor_formatter(plain if high < 10 * low else NullFormatter())  # label minors in 1 decade
            ax.set_xlabel("message size")
            ax.set_ylabel(ylabel)
            ax.set_title(_group_label(group), fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(_title(doc), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_run(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read benchmark JSON {path}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise InvalidArgument(f"{path} is not a JSON file written by `mpigpu.bench --json` (no 'results' list)")
    return doc


def compare(a_path: Path, b_path: Path) -> list[str]:
    """The table of B/A time ratios for every path, call and size measured in both runs (rows of a
    run written before calls were recorded count as prepared calls, which is what they were)."""
    a, b = load_run(a_path), load_run(b_path)

    def index(doc: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
        return {(_row_column(r), *_group_of(r), r["bytes"]): r for r in doc["results"]}

    ia, ib = index(a), index(b)
    common = [k for k in ia if k in ib]
    lines = [f"# A: {a_path}  {_title(a)}", f"# B: {b_path}  {_title(b)}"]
    lines.append(
        f"#{'path':>15} {'place':>5} {'type':>9} {'redop':>5} {'mode':>5} {'size':>12} "
        f"{'A(us)':>11} {'B(us)':>11} {'B/A':>7} {'busbw A':>9} {'busbw B':>9}"
    )
    logs: dict[str, list[float]] = {}
    for key in common:
        ra, rb = ia[key], ib[key]
        ta, tb = ra["median_us"] or ra["time_us"], rb["median_us"] or rb["time_us"]
        ratio = tb / ta if ta else math.inf
        if math.isfinite(ratio) and ratio > 0:
            logs.setdefault(f"{key[0]} ({PLACE_LABEL.get(key[1], key[1])})", []).append(math.log(ratio))
        lines.append(
            f" {key[0]:>15} {PLACE_LABEL.get(key[1], key[1]):>5} {key[2]:>9} {key[3]:>5} "
            f"{'in' if key[4] else 'out':>5} {key[5]:>12} {ta:>11.2f} {tb:>11.2f} {ratio:>7.3f} "
            f"{ra['busbw_gbps']:>9.3f} {rb['busbw_gbps']:>9.3f}"
        )
    for name, values in logs.items():
        lines.append(f"# {name}: B/A geometric mean {math.exp(sum(values) / len(values)):.3f} over {len(values)} sizes")
    only_a, only_b = len(ia) - len(common), len(ib) - len(common)
    lines.append(f"# {len(common)} measurements in both; {only_a} only in A, {only_b} only in B")
    return lines
