"""``python -m mpigpu.timeline``: merging rank files into a Chrome trace, the report, the plot (no MPI)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mpigpu.timeline import main
from mpigpu.timeline.report import analyse, format_report
from mpigpu.timeline.traces import load

MS = 1_000_000


def _call(seq: int, begin: int, comm: int = 0) -> dict[str, Any]:
    marks = {"begin": begin, "checked": begin + 1, "launched": begin + 2, "done": begin + 2}
    return {"kind": "call", "lane": "calls", "name": "allreduce", "comm": comm, "seq": seq, "bytes": 8,
            "backend": "cpu", "marks": marks}  # fmt: skip


def _bucket(index: int, launch: int, done: int, step: int = 0) -> dict[str, Any]:
    return {"kind": "bucket", "lane": "buckets", "name": f"bucket {index}", "comm": 0, "seq": step, "bytes": 1024,
            "backend": "cpu", "group": 0, "step": step, "bucket": index,
            "marks": {"ready": launch, "launch": launch, "launched": launch + 1, "done": done}}  # fmt: skip


def _write(directory: Path, rank: int, size: int, events: list[dict[str, Any]], offset: int = 0, **extra: Any) -> None:
    doc = {"format": "mpigpu-timeline", "version": 1, "rank": rank, "size": size, "host": f"h{rank}",
           "offset_ns": offset, "capacity": 100, "recorded": len(events), "dropped": 0, "events": events}  # fmt: skip
    doc.update(extra)
    directory.mkdir(exist_ok=True)
    (directory / f"rank{rank}.json").write_text(json.dumps(doc))


@pytest.fixture
def three_ranks(tmp_path: Path) -> Path:
    """Rank 2 starts call 1 5 ms after the others; rank 1's clock runs 1 s behind rank 0's (its offset)."""
    d = tmp_path / "tl"
    for rank in range(3):
        offset = 1000 * MS if rank == 1 else 0
        late = 5 * MS if rank == 2 else 0
        events = [_call(0, 10 * MS - offset), _call(1, 20 * MS + late - offset)]
        if rank == 0:
            # backward 0..10 ms of step 0; buckets reduce 2..6 and 5..12 ms: 10 ms in all, 8 inside backward
            backward = {"kind": "span", "lane": "backward", "name": "backward", "step": 0, "group": 0,
                        "marks": {"begin": 0, "end": 9 * MS, "done": 10 * MS}}  # fmt: skip
            events += [backward, _bucket(0, 2 * MS, 6 * MS), _bucket(1, 5 * MS, 12 * MS)]
        else:
            events += [_bucket(0, 2 * MS - offset, 6 * MS - offset), _bucket(1, 5 * MS - offset, 12 * MS - offset)]
        _write(d, rank, 3, events, offset)
    return d


def test_the_report_names_the_late_rank_and_the_wait(three_ranks: Path) -> None:
    report = analyse(load(three_ranks))
    assert report.unmatched == 0 and len(report.matched) == 4  # two calls, two buckets: clocks aligned by offset
    late = next(m for m in report.matched if m.key == ("call", 0, 1))
    assert late.last == 2 and late.waits == [5 * MS, 5 * MS, 0]
    text = format_report(report)
    assert "allreduce #1 (comm 0)" in text
    row = next(line for line in text.splitlines() if line.startswith("allreduce #1"))
    assert row.split()[-3:] == ["2", "10.000", "5.000"]  # last rank, sum of the waits, worst wait
    per_rank = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert per_rank["2"][2] == "10.000"


def test_hidden_is_the_buckets_union_inside_backward(three_ranks: Path) -> None:
    h = analyse(load(three_ranks)).hidden
    assert h is not None and h.steps == 1
    assert h.hidden_ms[0] == pytest.approx(8.0) and h.total_ms[0] == pytest.approx(10.0)
    assert h.hidden_ms[1] == 0.0 and h.total_ms[1] == pytest.approx(10.0)  # no backward recorded there
    assert "rank 0: 8.000 ms of 10.000 ms hidden (80.0%)" in format_report(analyse(load(three_ranks)))


def test_merge_writes_a_chrome_trace_with_every_rank(three_ranks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = three_ranks.parent / "trace.json"
    assert main(["merge", str(three_ranks), "-o", str(out)]) == 0
    assert "rank" in capsys.readouterr().out
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2}
    for e in slices:
        assert isinstance(e["name"], str) and e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["tid"], int)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert (0, "backward") in names and (0, "calls (host)") in names and (1, "bucket 1") in names
    # one clock: the call that rank 2 started late starts 5 ms later in the trace, rank 1's offset applied
    starts = {e["pid"]: e["ts"] for e in slices if e["name"] == "allreduce" and e["args"]["seq"] == 1}
    assert starts[0] == starts[1] and starts[2] - starts[0] == pytest.approx(5000.0)
    nested = [e for e in slices if e["pid"] == 0 and e["tid"] == 1]
    assert {e["name"] for e in nested} == {"allreduce", "check", "launch"}


def test_check_takes_a_reduction_done_before_its_start_returned(tmp_path: Path) -> None:
    """done may precede launched (the GPU finished while the host's start call had not returned), not
    launch; the host's own marks must be in order."""
    from mpigpu.timeline.check import _bucket_problems

    def bucket(**marks: int) -> dict[str, Any]:
        return {"step": 0, "bucket": 0, "marks": {"ready": 1, "launch": 2, "launched": 10, "done": 12, **marks}}

    assert _bucket_problems(0, bucket()) == []
    assert _bucket_problems(0, bucket(done=9)) == [], "done before launched: a slow start call"
    assert "out of order" in _bucket_problems(0, bucket(done=1))[0], "done before its launch began"
    assert "out of order" in _bucket_problems(0, bucket(launch=11))[0], "launch after launched"
    assert "out of order" in _bucket_problems(0, bucket(ready=3))[0], "ready after launch"


def test_a_missing_rank_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "tl", 0, 3, [_call(0, 1)])
    _write(tmp_path / "tl", 2, 3, [_call(0, 1)])
    assert main(["merge", str(tmp_path / "tl")]) == 2
    assert "lacks the files of rank(s) 1 of 3" in capsys.readouterr().err


def test_an_empty_directory_says_how_to_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["merge", str(tmp_path)]) == 2
    assert "MPIGPU_TIMELINE=" in capsys.readouterr().err


def test_calls_seen_on_some_ranks_only_are_counted_not_matched(tmp_path: Path) -> None:
    _write(tmp_path / "tl", 0, 2, [_call(0, 1), _call(1, 5)])
    _write(tmp_path / "tl", 1, 2, [_call(1, 6)], dropped=1)  # its call 0 fell out of the ring
    report = analyse(load(tmp_path / "tl"))
    assert report.unmatched == 1 and [m.key for m in report.matched] == [("call", 0, 1)]
    assert "dropped" in format_report(report) and "rank 1: 1" in format_report(report)


def test_plot_draws_a_step_from_a_directory_or_a_trace(three_ranks: Path) -> None:
    pytest.importorskip("matplotlib", reason="plot needs matplotlib (the plot extra)")
    png = three_ranks.parent / "step.png"
    assert main(["plot", str(three_ranks), "-o", str(png), "--step", "0"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    main(["merge", str(three_ranks), "-o", str(three_ranks.parent / "trace.json")])
    png.unlink()
    assert main(["plot", str(three_ranks.parent / "trace.json"), "-o", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert main(["plot", str(three_ranks), "-o", str(png), "--step", "7"]) == 2  # not recorded: says so


def test_help_explains_the_lanes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "merge" in out and "plot" in out and "backward" in out and "arrived last" in out
