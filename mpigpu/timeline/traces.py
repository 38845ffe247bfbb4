"""The ranks' timeline files, read and checked, and merged into one Chrome/Perfetto trace.

Every time is put on rank 0's clock (each file's ``offset_ns`` added) and shown in microseconds from
the earliest event. Processes are ranks (pid = rank); threads are lanes: the calls on the host, the
calls' completion on the GPU, one row per training bucket (buckets overlap in time), the backward
pass and the step (``finish``, the optimizer's step).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpigpu.core.timeline import FORMAT

__all__ = ["Rank", "TraceError", "chrome_trace", "load", "load_any"]

# lane -> (tid, name); buckets take tids from _BUCKET_TID on, one per bucket index
_LANES = {"calls": (1, "calls (host)"), "gpu": (2, "calls (GPU completion)"), "backward": (3, "backward"),
          "step": (4, "step (finish, optimizer)")}  # fmt: skip
_BUCKET_TID = 100


class TraceError(Exception):
    """A timeline directory or trace that cannot be read (the message says which file and why)."""


@dataclass
class Rank:
    """One rank's file: its events with every time on rank 0's clock (ns)."""

    rank: int
    size: int
    host: str
    dropped: int
    recorded: int
    capacity: int
    events: list[dict[str, Any]]
    node: int = -1  # its node (MPI_COMM_TYPE_SHARED, or MPIGPU_NODE_SIZE's); -1 in files written before it was kept

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "size": self.size, "host": self.host, "node": self.node, "dropped": self.dropped,
                "recorded": self.recorded, "capacity": self.capacity, "events": self.events}  # fmt: skip

    @property
    def label(self) -> str:
        """``rank 2 (node 1, host gpu07)``: how the merged trace names this rank's process."""
        where = f"node {self.node}, host {self.host}" if self.node >= 0 else self.host
        return f"rank {self.rank} ({where})"


def _rank_of(doc: dict[str, Any], where: str) -> Rank:
    if doc.get("format") != FORMAT:
        raise TraceError(f'{where} is not an mpigpu timeline file (no "format": "{FORMAT}")')
    offset = int(doc.get("offset_ns", 0))
    events = []
    for event in doc["events"]:
        event = dict(event)
        event["marks"] = {label: int(ns) + offset for label, ns in event["marks"].items()}
        events.append(event)
    return Rank(int(doc["rank"]), int(doc["size"]), str(doc.get("host", "")), int(doc.get("dropped", 0)),
                int(doc.get("recorded", len(events))), int(doc.get("capacity", 0)), events,
                int(doc.get("node", -1)))  # fmt: skip


def load(directory: Path) -> list[Rank]:
    """Every ``rank<r>.json`` of ``directory``, in rank order; TraceError if one is missing or unreadable."""
    files = sorted(directory.glob("rank*.json"))
    if not files:
        raise TraceError(
            f"{directory} holds no rank<r>.json: run the job with MPIGPU_TIMELINE={directory} first "
            "(each rank writes its file at mpigpu.finalize() and at exit)"
        )
    ranks = []
    for path in files:
        try:
            ranks.append(_rank_of(json.loads(path.read_text()), str(path)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{path} cannot be read: {exc}") from None
    ranks.sort(key=lambda r: r.rank)
    size = ranks[0].size
    missing = sorted(set(range(size)) - {r.rank for r in ranks})
    if missing:
        raise TraceError(
            f"{directory} lacks the files of rank(s) {', '.join(map(str, missing))} of {size}: did those ranks end "
            "before writing them (killed, or MPI_Abort)? Merge what is there by copying the others elsewhere."
        )
    return ranks


def load_any(path: Path) -> list[Rank]:
    """The ranks of a timeline directory, or of a trace written by ``merge`` (which keeps them)."""
    if path.is_dir():
        return load(path)
    try:
        doc = json.loads(path.read_text())
        return [Rank(**r) for r in doc["mpigpu"]["ranks"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{path} is neither a timeline directory nor a trace written by merge: {exc}") from None


def _x(name: str, pid: int, tid: int, start: int, end: int, t0: int, args: dict[str, Any] | None = None) -> dict:
    event = {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": (start - t0) / 1e3,
        "dur": max(0, end - start) / 1e3,
    }
    if args:
        event["args"] = args
    return event


def _children(pid: int, tid: int, marks: dict[str, int], steps: list[tuple[str, str, str]], t0: int) -> Iterator[dict]:
    """The parts of an event between consecutive marks, as nested slices."""
    for label, a, b in steps:
        if a in marks and b in marks and marks[b] > marks[a]:
            yield _x(label, pid, tid, marks[a], marks[b], t0)


def start_of(ranks: list[Rank]) -> int:
    """The earliest time of any event (ns, rank 0's clock)."""
    return min((min(e["marks"].values()) for r in ranks for e in r.events if e["marks"]), default=0)


def chrome_trace(ranks: list[Rank]) -> dict[str, Any]:
    """The Chrome/Perfetto trace (JSON object format) of every rank's events; the ranks themselves
    ride along under "mpigpu" so that ``plot`` can read a merged trace too."""
    t0 = start_of(ranks)
    out: list[dict[str, Any]] = []
    for r in ranks:
        pid = r.rank
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": r.label}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": r.rank}})
        tids: dict[int, str] = {}
        for e in r.events:
            m = e["marks"]
            if e["kind"] == "call":
                args = {"bytes": e["bytes"], "backend": e["backend"], "comm": e["comm"], "seq": e["seq"]}
                tid = _LANES["calls"][0]
                tids[tid] = _LANES["calls"][1]
                end = m.get("launched", max(m.values()))
                out.append(_x(e["name"], pid, tid, m["begin"], end, t0, args))
                steps = [("check", "begin", "checked"), ("launch", "checked", "launched")]
                out.extend(_children(pid, tid, m, steps, t0))
                if "done" in m and m["done"] > end:
                    gpu = _LANES["gpu"][0]
                    tids[gpu] = _LANES["gpu"][1]
                    out.append(_x(f"{e['name']} on GPU", pid, gpu, end, m["done"], t0, args))
            elif e["kind"] == "bucket":
                tid = _BUCKET_TID + e["bucket"]
                tids[tid] = f"bucket {e['bucket']}"
                args = {"bytes": e["bytes"], "backend": e["backend"], "step": e["step"], "group": e["group"]}
                end = m.get("done", max(m.values()))
                out.append(_x(f"bucket {e['bucket']} (step {e['step']})", pid, tid, m["ready"], end, t0, args))
                steps = [("queued", "ready", "launch"), ("pack + start", "launch", "launched"),
                         ("reducing", "launched", "done")]  # fmt: skip
                out.extend(_children(pid, tid, m, steps, t0))
            else:
                tid, lane_name = _LANES.get(e["lane"], (9, e["lane"]))
                tids[tid] = lane_name
                end = max(m["end"], m.get("done", m["end"]))
                args = {k: e[k] for k in ("step", "group") if k in e}
                out.append(_x(e["name"], pid, tid, m["begin"], end, t0, args))
        for tid, name in tids.items():
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "mpigpu": {"ranks": [r.as_dict() for r in ranks], "start_ns": t0},
    }
