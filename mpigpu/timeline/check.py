"""Is a timeline complete? Every rank's file, and for each training step every bucket's events on every rank.

``python -m mpigpu.timeline check DIR`` prints what is missing and exits 1, so that a job (and
gpu-check) can tell a trace that explains a step from one that silently lacks a rank or a bucket.
A bucket event is complete when it holds ready <= launch <= launched and launch <= done (the GPU may
finish the reduction before the host's start call returns: measured on 2 x H100, a 2.4 ms start
whose reduction was done 55 us before it returned); a step has a backward
span (BackwardAverager) on every rank, and every bucket of the step was ready inside it.
"""

from __future__ import annotations

from typing import Any

from mpigpu.timeline.traces import Rank

__all__ = ["problems"]

_BUCKET_MARKS = ("ready", "launch", "launched", "done")


def _bucket_problems(rank: int, event: dict[str, Any]) -> list[str]:
    where = f"rank {rank}: step {event.get('step')} bucket {event.get('bucket')}"
    marks = event["marks"]
    missing = [m for m in _BUCKET_MARKS if m not in marks]
    if missing:
        return [f"{where} has no {', '.join(missing)} mark"]
    host = [marks[m] for m in _BUCKET_MARKS[:3]]  # ready, launch, launched: one thread's clock, in order
    if host != sorted(host) or marks["done"] < marks["launch"]:
        return [f"{where}: its marks are out of order ({', '.join(f'{m} {marks[m]}' for m in _BUCKET_MARKS)})"]
    return []


def problems(ranks: list[Rank], *, backward: bool = True) -> list[str]:
    """What the timeline lacks, one line each (empty: complete). ``backward``: every step needs its
    backward span (the BackwardAverager's); off for the Averager called after backward."""
    if not ranks:
        return ["no rank's file"]
    found: list[str] = []
    size = ranks[0].size
    present = sorted(r.rank for r in ranks)
    if present != list(range(size)):
        lacking = sorted(set(range(size)) - set(present))
        found.append(f"the job had {size} ranks; no file from rank(s) {', '.join(map(str, lacking))}")
    for r in ranks:
        if r.dropped:
            found.append(f"rank {r.rank} dropped {r.dropped} of {r.recorded} events (raise MPIGPU_TIMELINE_EVENTS)")
    per_rank: dict[int, set[tuple[int, int]]] = {}
    for r in ranks:
        buckets = [e for e in r.events if e["kind"] == "bucket"]
        for e in buckets:
            found.extend(_bucket_problems(r.rank, e))
        per_rank[r.rank] = {(e["step"], e["bucket"]) for e in buckets}
        if not buckets:
            found.append(f"rank {r.rank} recorded no bucket")
            continue
        if backward:
            spans = {e["step"]: e for e in r.events if e["kind"] == "span" and e["lane"] == "backward"}
            for step in sorted({e["step"] for e in buckets}):
                span = spans.get(step)
                if span is None:
                    found.append(f"rank {r.rank}: step {step} has no backward span")
                    continue
                late = [e["bucket"] for e in buckets if e["step"] == step
                        and not span["marks"]["begin"] <= e["marks"]["ready"] <= span["marks"]["end"]]  # fmt: skip
                if late:
                    found.append(f"rank {r.rank}: step {step}: bucket(s) {late} were not ready inside backward")
    union = set().union(*per_rank.values())
    for rank, seen in sorted(per_rank.items()):
        lacking = sorted(union - seen)
        if lacking:
            shown = ", ".join(f"step {s} bucket {b}" for s, b in lacking[:6])
            more = f" and {len(lacking) - 6} more" if len(lacking) > 6 else ""
            found.append(f"rank {rank} lacks {shown}{more}, which other ranks recorded")
    return found
