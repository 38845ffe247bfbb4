"""Several devices per process on the CPU (host devices, NumPy): ``python -m mpigpu.average
--devices-per-rank N`` verifies the average over every (rank, device) participant, bad values are refused
with one line and exit status 2, ``python -m mpigpu.info`` shows each rank's devices and participants,
scripts/per_process_bench.py answers --help, --merge and its no-GPU refusal here, and
scripts/jax_step_bench.py --local-devices runs on XLA's host devices. Serial tests: each one launches
what it tests (``run_mpi``, or a plain subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, gpu_available, run_mpi

from mpigpu.cli import launcher_rank

pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

HOST_ONLY = pytest.mark.skipif(gpu_available(), reason="host devices: GPU processes drive GPUs (tests/gpu)")
QUICK = ["--iters", "3", "--warmup", "1"]


def _average(n: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_mpi(n, ["-m", "mpigpu.average", *args], timeout=120, env=env)


def _serial(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full, check=False)  # fmt: skip


@HOST_ONLY
def test_two_ranks_of_two_devices_average_over_four_participants(tmp_path) -> None:
    out = tmp_path / "average.json"
    done = _average(2, "--devices-per-rank", "2", "--size", "4K", *QUICK, "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    # grad[i] = p + 0.001*i for participants p = 0..3: the rank-numbered fill (0, 0, 1, 1) would fail the check
    assert "# PASS: 0 wrong elements over 4 participants (2 ranks x 2 devices), backend cpu" in done.stdout
    assert "# 4 participants (2 ranks x 2 devices): one thread per device (mpigpu.on_device)" in done.stdout
    assert "#  Rank   1 drives host device 0, host device 1: participants 2-3" in done.stdout
    assert "# backend: auto -> cpu" in done.stdout
    document = json.loads(out.read_text())
    assert document["ok"] and document["participants"] == 4 and document["devices_per_rank"] == [2, 2]
    assert document["ranks"] == 2 and document["backend"] == "cpu"
    row = document["results"][0]
    assert row["wrong"] == 0 and row["ranks"] == 4 and len(row["per_participant_us"]) == 4


@HOST_ONLY
@pytest.mark.parametrize(
    ("n", "devices", "args", "summary"),
    [
        (1, "3", [], "over 3 participants (1 rank x 3 devices)"),
        (3, "1", [], "over 3 participants (3 ranks x 1 device)"),
        (1, "1", [], "over 1 participant (1 rank x 1 device)"),
        (2, "2", ["--dtype", "int32", "--op", "sum", "--out-of-place"], "over 4 participants (2 ranks x 2 devices)"),
        (2, "3", ["--op", "max", "--backend", "cpu"], "over 6 participants (2 ranks x 3 devices)"),
        (2, "2", ["--dtype", "bfloat16"], "over 4 participants (2 ranks x 2 devices)"),
    ],
)
def test_layouts_and_calls_pass(n: int, devices: str, args: list[str], summary: str) -> None:
    done = _average(n, "--devices-per-rank", devices, "--size", "1K", *QUICK, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"# PASS: 0 wrong elements {summary}, backend cpu" in done.stdout, done.stdout


@HOST_ONLY
def test_wrong_elements_are_counted_over_every_participant() -> None:
    done = _average(2, "--devices-per-rank", "2", "--size", "1K", *QUICK, "--corrupt", "3", "--quiet")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "# FAIL: 3 wrong elements over 4 participants (2 ranks x 2 devices), backend cpu" in done.stdout


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "5000"])
def test_a_bad_count_is_refused_with_one_line_and_status_2(value: str) -> None:
    done = _average(2, f"--devices-per-rank={value}", "--size", "1K")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "python -m mpigpu.average: error: argument --devices-per-rank: " in done.stderr, done.stderr
    assert done.stderr.count("error:") == 1, "one line per job, not one per rank"
    assert "Traceback" not in done.stderr and "PASS" not in done.stdout
    alone = _serial(["-m", "mpigpu.average", f"--devices-per-rank={value}"])
    assert alone.returncode == 2 and "error: argument --devices-per-rank" in alone.stderr
    assert "Traceback" not in alone.stderr


@HOST_ONLY
def test_a_backend_without_a_several_devices_path_is_refused() -> None:
    done = _average(2, "--devices-per-rank", "2", "--size", "1K", "--backend", "ipc")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: backend 'ipc' does not take calls over several devices per process" in done.stderr
    assert done.stderr.count("error:") == 1 and "Traceback" not in done.stderr


@HOST_ONLY
def test_the_count_after_mpigpu_started_is_refused_as_too_late() -> None:
    code = (
        "import sys, numpy as np, mpigpu\n"
        "mpigpu.allreduce(np.ones(2, np.float32))\n"
        "from mpigpu.average import main\n"
        "sys.exit(main(['--devices-per-rank', '2', '--size', '1K']))\n"
    )
    done = _serial(["-c", code])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--devices-per-rank 2 comes too late: mpigpu has already started" in done.stderr
    assert "MPIGPU_DEVICES_PER_RANK=2 in the environment" in done.stderr and "Traceback" not in done.stderr


def test_help_explains_the_option() -> None:
    done = _serial(["-m", "mpigpu.average", "--help"])
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "--devices-per-rank N" in text and "participant (rank, device)" in text
    assert "sets MPIGPU_DEVICES_PER_RANK" in text and "mpigpu.on_device" in text


@HOST_ONLY
def test_info_shows_each_ranks_devices_and_participants() -> None:
    env = {"MPIGPU_DEVICES_PER_RANK": "2"}
    done = run_mpi(2, ["-m", "mpigpu.info"], env=env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Devices          4 participants (2 ranks x 2 devices)" in done.stdout, done.stdout
    assert "rank   1 -> host device 0, host device 1  (participants 2-3)" in done.stdout
    document = json.loads(run_mpi(2, ["-m", "mpigpu.info", "--json"], env=env, timeout=60).stdout)
    assert [row["participants"] for row in document["devices"]] == [[0, 1], [2, 3]]
    assert {row["kind"] for row in document["devices"]} == {"host"}


# -- scripts/per_process_bench.py --------------------------------------------------------------------------
BENCH = "scripts/per_process_bench.py"


def test_per_process_bench_help_imports_nothing_of_the_gpu() -> None:
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['{BENCH}', '--help']\n"
        "try:\n"
        f"    runpy.run_path('{BENCH}', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('loaded:', sorted(m for m in ('cupy', 'torch', 'mpi4py', 'jax') if m in sys.modules))\n"
    )
    done = _serial(["-c", code])
    assert done.returncode == 0, done.stderr
    assert "--merge" in done.stdout and "--sizes" in done.stdout and "loaded: []" in done.stdout


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU: the benchmark runs")
def test_per_process_bench_without_a_gpu_says_what_it_needs() -> None:
    done = run_mpi(2, [BENCH], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count(f"{BENCH} needs a CUDA GPU and the CUDA extra") == 1, done.stderr
    assert "Traceback" not in done.stderr


def _layout(layout: str, processes: int, paths: list[str]) -> dict:
    sizes = [8, 1 << 20]
    results = {
        name: {str(n): {"median_us": 10.0 * (i + 1), "ratio_to_nccl_raw": (i + 1) / len(paths), "checked": True}
               for n in sizes}
        for i, name in enumerate(paths)
    }  # fmt: skip
    return {"ok": True, "layout": layout, "processes": processes, "gpus_per_process": 2 // processes,
            "machine": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 2, "host": "h"},
            "versions": {"cupy": "13.6.0", "nccl": "2.27.3", "torch": "2.9.0", "mpi4py": "4.1.0",
                         "mpi_library": "Open MPI v5.0.8"},
            "date": "2026-11-26T00:00:00+00:00", "framework": "torch", "rounds": 7, "method": "m",
            "sizes": sizes, "paths": paths, "results": results, "skipped": {}}  # fmt: skip


def test_per_process_bench_merges_both_layouts_into_one_table(tmp_path) -> None:
    one = tmp_path / "1x2.json"
    two = tmp_path / "2x1.json"
    one.write_text(json.dumps(_layout("1x2", 1, ["threads", "list", "nccl-raw"])))
    two.write_text(json.dumps(_layout("2x1", 2, ["on_device", "allreduce", "torch-nccl", "nccl-raw"])))
    out = tmp_path / "gpus-per-process-h100x2-2026-11-26.txt"
    done = _serial([BENCH, "--merge", str(two), str(one), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text == done.stdout
    lines = text.splitlines()
    assert "1x2 (1 process x 2 GPUs) vs 2x1 (2 processes x 1 GPU)" in lines[0]
    assert "2 x NVIDIA H100 80GB HBM3" in text and "nccl 2.27.3" in text and "mpi4py 4.1.0" in text
    rows = [line for line in lines if line[:3] in ("1x2", "2x1")]
    assert len(rows) == 7 and rows[0].startswith("1x2") and rows[-1].startswith("2x1")
    assert "8 B" in text and "1 MiB" in text and "(1.00x)" in text
    missing = _serial([BENCH, "--merge", str(tmp_path / "none.json")])
    assert missing.returncode == 2 and "cannot read" in missing.stderr
