"""One training step of the merged timeline as a PNG: a band of lanes per rank (calls, calls' GPU
completion, buckets, backward, step), time in milliseconds from the step's start."""

from __future__ import annotations

from pathlib import Path

from mpigpu.timeline.traces import Rank, TraceError

__all__ = ["plot_step", "step_window", "steps"]

_LANES = ("step", "backward", "buckets", "gpu", "calls")  # top to bottom within a rank's band
# by lane, and by name where a lane holds nested spans
_COLOURS = {"calls": "tab:blue", "gpu": "tab:cyan", "backward": "tab:green", "step": "tab:gray",
            "optimizer step": "lightgray", "finish": "tab:orange"}  # fmt: skip


def steps(ranks: list[Rank]) -> list[int]:
    """The training steps every rank recorded (step numbers of the first Averager group seen)."""
    per_rank = []
    for r in ranks:
        per_rank.append({e["step"] for e in r.events if e["kind"] in ("bucket", "span") and "step" in e})
    common = set.intersection(*per_rank) if per_rank else set()
    return sorted(common)


def step_window(ranks: list[Rank], step: int | None) -> tuple[int, int, int | None]:
    """(start, end) in ns of ``step`` on every rank (default: the last step all ranks recorded), and
    the step; the whole trace where no training step was recorded."""
    known = steps(ranks)
    if not known:
        times = [t for r in ranks for e in r.events for t in e["marks"].values()]
        if not times:
            raise TraceError("the timeline holds no events")
        return min(times), max(times), None
    if step is None:
        step = known[-1]
    if step not in known:
        raise TraceError(f"step {step} was not recorded on every rank; recorded: {known[0]}..{known[-1]}")
    times = [
        t for r in ranks for e in r.events if e["kind"] in ("bucket", "span") and e.get("step") == step
        for t in e["marks"].values()
    ]  # fmt: skip
    return min(times), max(times), step


def _bars(rank: Rank, lo: int, hi: int) -> dict[str, list[tuple[int, int, str]]]:
    """Per lane, the (start, end, label) of the events that overlap [lo, hi]."""
    bars: dict[str, list[tuple[int, int, str]]] = {lane: [] for lane in _LANES}
    for e in rank.events:
        m = e["marks"]
        if e["kind"] == "call":
            spans = [("calls", m["begin"], m.get("launched", m["begin"]), e["name"])]
            if "done" in m and "launched" in m and m["done"] > m["launched"]:
                spans.append(("gpu", m["launched"], m["done"], e["name"]))
        elif e["kind"] == "bucket":
            start = m.get("launch", m["ready"])
            spans = [("buckets", start, m.get("done", start), f"b{e['bucket']:02d}")]
        else:
            spans = [(e["lane"], m["begin"], max(m["end"], m.get("done", m["end"])), e["name"])]
        for lane, a, b, label in spans:
            if lane in bars and b >= lo and a <= hi:
                bars[lane].append((a, b, label))
    return bars


def plot_step(ranks: list[Rank], path: Path, step: int | None = None, title: str = "") -> int | None:
    """Draw ``step`` (default: the last one every rank recorded) to ``path`` (PNG); return the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi, step = step_window(ranks, step)
    margin = max(1, (hi - lo) // 20)
    lo, hi = lo - margin, hi + margin
    fig, ax = plt.subplots(figsize=(12, 1.1 + 1.3 * len(ranks)))
    ticks, labels = [], []
    row = 0
    for r in reversed(ranks):
        bars = _bars(r, lo, hi)
        for lane in _LANES:
            if not bars[lane] and lane in ("gpu", "calls"):
                continue
            indices = sorted({label for _, _, label in bars[lane]}) if lane == "buckets" else [""]
            height = 0.8 / max(1, len(indices))  # buckets overlap in time: one sub-row each
            for a, b, label in sorted(bars[lane], key=lambda bar: (bar[0], -bar[1])):  # outer spans first
                k = indices.index(label) if lane == "buckets" else 0
                colour = f"C{k % 10}" if lane == "buckets" else _COLOURS.get(label, _COLOURS.get(lane, "tab:gray"))
                width = max((b - a) / 1e6, (hi - lo) / 1e6 / 1000)  # at least a hair, so instants show
                y = row + 0.1 + k * height
                ax.broken_barh([((a - lo) / 1e6, width)], (y, height), facecolors=colour, edgecolor="black",
                               linewidth=0.3)  # fmt: skip
                if lane == "buckets" and (b - a) > (hi - lo) / 40:
                    ax.text((a - lo) / 1e6 + width / 2, y + height / 2, label, ha="center", va="center", fontsize=6)
            ticks.append(row + 0.5)
            labels.append(f"rank {r.rank} {lane}")
            row += 1
        row += 0.5
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlim(0, (hi - lo) / 1e6)
    ax.set_xlabel("ms from the step's start" if step is not None else "ms")
    heading = title or ("mpigpu timeline" + (f", step {step}" if step is not None else ""))
    ax.set_title(heading)
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return step
