"""The timeline recorder (mpigpu.core.timeline) and its start-up (mpigpu.job.timeline_start), in one process."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpigpu.core import timeline
from mpigpu.core.config import Settings
from mpigpu.core.errors import ConfigError
from mpigpu.core.privatefs import PrivateDir


@pytest.fixture
def recording(tmp_path: Path) -> Iterator[Path]:
    """The timeline on in this process, writing to tmp_path/tl (off again afterwards)."""
    assert not timeline.on, "the timeline must be off unless MPIGPU_TIMELINE is set"
    directory = tmp_path / "tl"
    timeline.start(PrivateDir.open(directory), rank=0, size=1, capacity=5)
    try:
        yield directory
    finally:
        timeline.stop()


def test_off_unless_started() -> None:
    """Nothing runs MPIGPU_TIMELINE here: the hooks' one test is False and there is no recorder."""
    assert "MPIGPU_TIMELINE" not in os.environ
    import mpigpu  # noqa: F401 - importing starts nothing

    assert timeline.on is False
    assert timeline.recorder() is None
    timeline.flush()  # off: writes nothing, raises nothing


def test_the_ring_keeps_the_newest_events_and_counts_the_dropped(recording: Path) -> None:
    for _ in range(12):
        event = timeline.begin("allreduce", 8, "cpu", comm=3)
        event.mark("checked")
        timeline.end(event, None)
    rec = timeline.recorder()
    assert rec is not None and len(rec.events) == 5 and rec.recorded == 12 and rec.dropped == 7
    timeline.flush()
    doc = json.loads((recording / "rank0.json").read_text())
    assert doc["format"] == "mpigpu-timeline" and doc["dropped"] == 7 and doc["recorded"] == 12
    assert [e["seq"] for e in doc["events"]] == [7, 8, 9, 10, 11]  # numbered in call order, dropped ones too
    marks = doc["events"][0]["marks"]
    assert marks["begin"] <= marks["checked"] <= marks["launched"] == marks["done"]  # host work: done at return


def test_the_file_is_private_and_replaced_whole(recording: Path) -> None:
    timeline.span("backward", "backward", 1, 2, step=0, group=0)
    timeline.flush()
    timeline.span("backward", "backward", 3, 4, step=1, group=0)
    timeline.flush()
    assert stat.S_IMODE(recording.stat().st_mode) == 0o700
    path = recording / "rank0.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [e["step"] for e in json.loads(path.read_text())["events"]] == [0, 1]
    assert sorted(p.name for p in recording.iterdir()) == ["rank0.json"]  # no temporary file left


def test_wrap_records_each_launch_as_a_call(recording: Path) -> None:
    launched = []
    wrapped = timeline.wrap(lambda stream, *rest: launched.append(rest), "allreduce start", 16, "cpu", 0, False)
    wrapped(None, "x", "out")
    wrapped(None)
    rec = timeline.recorder()
    assert rec is not None and launched == [("x", "out"), ()]
    assert [(e.name, e.seq, e.nbytes) for e in rec.events] == [("allreduce start", 0, 16), ("allreduce start", 1, 16)]


def _start(directory: Path) -> None:
    from mpigpu.core._mpi import MPI
    from mpigpu.job.timeline_start import start_timeline

    start_timeline(MPI().COMM_SELF, Settings(timeline=directory), 0)


def test_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symbolic link"):
        _start(tmp_path / "link")
    assert timeline.on is False and not list((tmp_path / "real").iterdir())


def test_a_directory_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "theirs").mkdir(mode=0o700)
    import mpigpu.core.privatefs as privatefs

    monkeypatch.setattr(privatefs.os, "geteuid", lambda: os.getuid() + 4242)  # the directory is now someone else's
    with pytest.raises(ConfigError, match=r"owned by uid .* not by you"):
        _start(tmp_path / "theirs")
    assert timeline.on is False


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        _start(shared)
    assert timeline.on is False


def test_a_missing_directory_is_created_private(tmp_path: Path) -> None:
    try:
        _start(tmp_path / "new" / "tl")
        assert timeline.on is True
    finally:
        timeline.stop()
    assert stat.S_IMODE((tmp_path / "new" / "tl").stat().st_mode) == 0o700
    assert (tmp_path / "new" / "tl" / "rank0.json").exists()


def test_the_settings() -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPIGPU_TIMELINE", "/somewhere/tl")
        mp.setenv("MPIGPU_TIMELINE_EVENTS", "1K")
        settings = Settings.from_env()
    assert settings.timeline == Path("/somewhere/tl") and settings.timeline_events == 1024
    assert dict(settings.agreed())["MPIGPU_TIMELINE"] == 1  # on/off is agreed, not the path
    assert dict(Settings().agreed())["MPIGPU_TIMELINE"] is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPIGPU_TIMELINE_EVENTS", "0")
        with pytest.raises(ConfigError, match="MPIGPU_TIMELINE_EVENTS='0' is not valid"):
            Settings.from_env()
