"""What the merged timeline says: who waited for whom, and how much communication backward hid.

Collectives are matched across ranks by their order: a call by (communicator, its number in that
communicator's calls), a training bucket by (Averager, step, bucket). A rank's arrival is a call's
start or a bucket's launch; in each collective the rank that arrived last made every other rank
wait (last arrival - its own arrival). Hidden communication: per rank and step, the part of the
buckets' reductions (launch to done, their union) that lies inside the backward pass (first gradient
to the end of backward, on the GPU where it was measured there).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mpigpu.timeline.traces import Rank

__all__ = ["Hidden", "Matched", "Report", "analyse", "format_report", "hidden", "match"]


@dataclass
class Matched:
    """One collective seen on every rank: when each rank arrived."""

    key: tuple[Any, ...]
    name: str
    nbytes: int
    backend: str
    arrivals: list[int]  # ns, by rank

    @property
    def last(self) -> int:
        """The rank that arrived last (the lowest such rank on a tie)."""
        return max(range(len(self.arrivals)), key=lambda r: (self.arrivals[r], -r))

    @property
    def waits(self) -> list[int]:
        """How long each rank waited for the last one (ns; 0 for the last)."""
        latest = max(self.arrivals)
        return [latest - t for t in self.arrivals]

    def label(self) -> str:
        if self.key[0] == "call":
            return f"{self.name} #{self.key[2]} (comm {self.key[1]})"
        return f"{self.name} of step {self.key[2]} (averager {self.key[1]})"


@dataclass
class Hidden:
    """Per rank: reduction time (ms) inside backward, and in all, over ``steps`` steps."""

    hidden_ms: list[float]
    total_ms: list[float]
    steps: int


@dataclass
class Report:
    ranks: int
    events: int
    dropped: list[int]
    matched: list[Matched] = field(default_factory=list)
    unmatched: int = 0
    hidden: Hidden | None = None


def _arrival(event: dict[str, Any]) -> tuple[tuple[Any, ...], int] | None:
    marks = event["marks"]
    if event["kind"] == "call":
        return ("call", event["comm"], event["seq"]), marks["begin"]
    if event["kind"] == "bucket" and "launch" in marks:
        return ("bucket", event["group"], event["step"], event["bucket"]), marks["launch"]
    return None


def match(ranks: list[Rank]) -> tuple[list[Matched], int]:
    """The collectives every rank recorded (in the order of rank 0's arrivals), and how many keys only
    some ranks have (dropped from a full ring, or a step still in flight at the end)."""
    seen: dict[tuple[Any, ...], list[int | None]] = {}
    info: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in ranks:
        for event in r.events:
            found = _arrival(event)
            if found is None:
                continue
            key, t = found
            slots = seen.setdefault(key, [None] * len(ranks))
            slots[r.rank] = t
            info.setdefault(key, event)
    matched, unmatched = [], 0
    for key, times in seen.items():
        if any(t is None for t in times):
            unmatched += 1
            continue
        e = info[key]
        name = e["name"] if e["kind"] == "call" else f"bucket {e['bucket']}"
        matched.append(Matched(key, name, e["bytes"], e["backend"], [int(t) for t in times if t is not None]))
    matched.sort(key=lambda m: m.arrivals[0])
    return matched, unmatched


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def hidden(ranks: list[Rank]) -> Hidden | None:
    """The buckets' reduction time inside backward, per rank (None without backward spans)."""
    hidden_ms, total_ms, steps = [], [], 0
    any_backward = False
    for r in ranks:
        backward: dict[tuple[int, int], tuple[int, int]] = {}
        buckets: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for e in r.events:
            m = e["marks"]
            if e["kind"] == "span" and e["lane"] == "backward":
                backward[(e.get("group", 0), e.get("step", 0))] = (m["begin"], max(m["end"], m.get("done", m["end"])))
            elif e["kind"] == "bucket" and "launch" in m and "done" in m:
                buckets[(e["group"], e["step"])].append((m["launch"], m["done"]))
        any_backward = any_backward or bool(backward)
        inside = total = 0
        for key, spans in buckets.items():
            union = _union(spans)
            total += sum(b - a for a, b in union)
            if key in backward:
                lo, hi = backward[key]
                inside += sum(max(0, min(b, hi) - max(a, lo)) for a, b in union)
        steps = max(steps, len(backward))
        hidden_ms.append(inside / 1e6)
        total_ms.append(total / 1e6)
    return Hidden(hidden_ms, total_ms, steps) if any_backward else None


def analyse(ranks: list[Rank]) -> Report:
    matched, unmatched = match(ranks)
    return Report(
        ranks=len(ranks),
        events=sum(len(r.events) for r in ranks),
        dropped=[r.dropped for r in ranks],
        matched=matched,
        unmatched=unmatched,
        hidden=hidden(ranks),
    )


def format_report(report: Report, top: int = 10) -> str:
    """The report as text: per rank, how often it arrived last and how long the others waited for it;
    the ``top`` collectives waited for longest (0: all); the hidden communication."""
    lines = [f"# {report.ranks} ranks, {report.events} events"]
    if any(report.dropped):
        lines.append(
            "# dropped (the ring was full; raise MPIGPU_TIMELINE_EVENTS): "
            + ", ".join(f"rank {r}: {n}" for r, n in enumerate(report.dropped) if n)
        )
    lines.append(
        f"# {len(report.matched)} collectives matched on every rank by their order"
        + (
            f"; {report.unmatched} seen on some ranks only (dropped, or in flight at the end)"
            if report.unmatched
            else ""
        )
    )
    if report.matched:
        n = report.ranks
        last_in = [0] * n
        caused_sum = [0] * n  # ns the others waited for this rank, summed over its collectives
        caused_worst = [0] * n  # ns: the longest one rank waited for it in one collective
        for m in report.matched:
            waits, last = m.waits, m.last
            last_in[last] += 1
            caused_sum[last] += sum(waits)
            caused_worst[last] = max(caused_worst[last], max(waits))
        lines.append("# who arrived last (a call's start, a bucket's launch) and how long the others waited for it")
        lines.append(f"{'rank':>6} {'last in':>8} {'others waited, sum ms':>22} {'worst ms':>10}")
        for r in range(n):
            lines.append(f"{r:>6} {last_in[r]:>8} {caused_sum[r] / 1e6:>22.3f} {caused_worst[r] / 1e6:>10.3f}")
        ranked = sorted(report.matched, key=lambda m: -sum(m.waits))
        shown = ranked if top == 0 else ranked[:top]
        lines.append(f"# the collectives waited for longest ({len(shown)} of {len(ranked)})")
        lines.append(f"{'collective':<40} {'bytes':>12} {'backend':>10} {'last':>5} {'sum ms':>9} {'worst ms':>9}")
        for m in shown:
            waits = m.waits
            lines.append(
                f"{m.label():<40} {m.nbytes:>12} {m.backend:>10} {m.last:>5} {sum(waits) / 1e6:>9.3f} "
                f"{max(waits) / 1e6:>9.3f}"
            )
    h = report.hidden
    if h is None:
        lines.append("# hidden behind backward: no backward pass recorded (BackwardAverager records it)")
    else:
        lines.append(f"# communication hidden behind backward ({h.steps} steps): buckets' reductions inside backward")
        for r, (inside, total) in enumerate(zip(h.hidden_ms, h.total_ms, strict=True)):
            share = 100.0 * inside / total if total else 0.0
            lines.append(f"rank {r}: {inside:.3f} ms of {total:.3f} ms hidden ({share:.1f}%)")
        inside, total = sum(h.hidden_ms), sum(h.total_ms)
        lines.append(
            f"all ranks: {inside:.3f} ms of {total:.3f} ms hidden ({100.0 * inside / total if total else 0:.1f}%)"
        )
    return "\n".join(lines)
