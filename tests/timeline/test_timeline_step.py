"""scripts/timeline_step.py, the job gpu-check's timeline step runs on GPUs (ResNet-50), here on the host (the MLP):
every rank's file, every bucket's marks, a backward span per step, a merged trace with both ranks, a PNG of one
step; and ``python -m mpigpu.timeline check`` naming what a damaged timeline lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_mpi

pytest.importorskip("torch", reason="the BackwardAverager needs torch (the test extra installs the CPU build)")


def _timeline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mpigpu.timeline", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("job") / "tl"
    done = run_mpi(2, [str(ROOT / "scripts" / "timeline_step.py"), "--model", "mlp", "--steps", "3", "--device",
                       "cpu"], timeout=180, env={"MPIGPU_TIMELINE": str(directory)})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("mlp, 3 steps") == 2, done.stdout
    return directory


def test_the_job_records_a_complete_timeline(recorded: Path) -> None:
    done = _timeline("check", str(recorded))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# complete: 2 ranks, 3 steps" in done.stdout


def test_merge_and_plot_of_the_job(recorded: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plot needs matplotlib (the test extra installs it)")
    trace = tmp_path / "trace.json"
    done = _timeline("merge", str(recorded), "-o", str(trace))
    assert done.returncode == 0 and "hidden" in done.stdout, done.stdout + done.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert any(e["name"].startswith("bucket 0 (step 2)") for e in events if e.get("ph") == "X")
    png = tmp_path / "step.png"
    done = _timeline("plot", str(trace), "-o", str(png), "--title", "MLP, 2 ranks")
    assert done.returncode == 0, done.stdout + done.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def _copy(recorded: Path, tmp_path: Path) -> Path:
    damaged = tmp_path / "tl"
    damaged.mkdir()
    for path in recorded.iterdir():
        if path.name.startswith("rank"):
            (damaged / path.name).write_bytes(path.read_bytes())
    return damaged


def test_check_names_a_missing_rank(recorded: Path, tmp_path: Path) -> None:
    damaged = _copy(recorded, tmp_path)
    (damaged / "rank1.json").unlink()
    done = _timeline("check", str(damaged))
    assert done.returncode == 2 and "lacks the files of rank(s) 1 of 2" in done.stderr, done.stdout + done.stderr


def test_check_names_a_bucket_without_its_completion(recorded: Path, tmp_path: Path) -> None:
    damaged = _copy(recorded, tmp_path)
    doc = json.loads((damaged / "rank0.json").read_text())
    bucket = next(e for e in doc["events"] if e["kind"] == "bucket" and e["step"] == 1)
    del bucket["marks"]["done"]
    (damaged / "rank0.json").write_text(json.dumps(doc))
    done = _timeline("check", str(damaged))
    assert done.returncode == 1, done.stdout
    assert f"rank 0: step 1 bucket {bucket['bucket']} has no done mark" in done.stdout, done.stdout


def test_check_names_a_step_without_its_backward_span(recorded: Path, tmp_path: Path) -> None:
    damaged = _copy(recorded, tmp_path)
    doc = json.loads((damaged / "rank1.json").read_text())
    doc["events"] = [e for e in doc["events"]
                     if not (e["kind"] == "span" and e["lane"] == "backward" and e["step"] == 2)]  # fmt: skip
    (damaged / "rank1.json").write_text(json.dumps(doc))
    done = _timeline("check", str(damaged))
    assert done.returncode == 1 and "rank 1: step 2 has no backward span" in done.stdout, done.stdout
    assert _timeline("check", str(damaged), "--no-backward").returncode == 0
