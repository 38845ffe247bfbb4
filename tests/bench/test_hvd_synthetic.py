"""Issue 37's comparison: scripts/hvd_synthetic.py (runs alternated, img/sec parsed, JSON and verdict) on canned
output; the driver end to end at 2 ranks on the host with a tiny model (a stand-in torchvision whose
``models.tiny`` both sides build), the DDP side (python -m mpigpu.bench.synthetic) included; and the clear stop
without torchvision.

The driver's end-to-end run takes Horovod's own benchmark from HOROVOD_CHECKOUT (a Horovod work tree or bare git
directory) when that is set; without it, a copy of the DDP side stands in for Horovod's file, so the launches,
the alternation and the parsing are still run for real."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, load_script, mpiexec, run_mpi

pytest.importorskip("torch", reason="both sides train with torch (the test extra installs the CPU build)")

DRIVER = ROOT / "scripts" / "hvd_synthetic.py"
SUITE_SCRIPT = Path("examples/pytorch/pytorch_synthetic_benchmark.py")
TINY = ["--model", "tiny", "--batch-size", "2", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
        "--num-iters", "2", "--no-cuda"]  # fmt: skip


def _driver() -> Any:
    return load_script(DRIVER)


def _output(values: list[float], ranks: int = 2, device: str = "GPU") -> str:
    """What a run prints (either side), with a mean and +- as the benchmarks compute them."""
    from mpigpu.bench.synthetic import summary_lines

    lines = ["Model: resnet50", "Batch size: 32", f"Number of {device}s: {ranks}", "Running warmup...",
             "Running benchmark..."]  # fmt: skip
    lines += [f"Iter #{i}: {v:.1f} img/sec per {device}" for i, v in enumerate(values)]
    return "\n".join([*lines, *summary_lines(values, ranks, device)]) + "\n"


def test_parse_output_reads_every_figure() -> None:
    got = _driver().parse_output("warning: something\n" + _output([900.0, 1000.0, 1100.0]))
    assert got["iter_img_s"] == [900.0, 1000.0, 1100.0]
    assert got["device"] == "GPU" and got["ranks"] == 2
    assert got["img_s_per_device"] == 1000.0 and got["total_img_s"] == 2000.0
    # 1.96 population standard deviations: sqrt(20000 / 3) = 81.65 -> 160.0
    assert got["conf_per_device"] == 160.0 and got["total_conf"] == 320.1


def test_parse_output_names_what_is_missing() -> None:
    cut = _output([900.0, 1000.0]).split("Total img/sec")[0]
    with pytest.raises(ValueError, match="lacks the 'Total img/sec' line"):
        _driver().parse_output(cut)
    with pytest.raises(ValueError, match="'Iter #' lines, the 'Img/sec per' line, the 'Total img/sec' line"):
        _driver().parse_output("Traceback (most recent call last):\n")


def test_the_runs_alternate() -> None:
    assert _driver().schedule(3) == [(0, "hvd"), (0, "ddp"), (1, "ddp"), (1, "hvd"), (2, "hvd"), (2, "ddp")]


def _run(pair: int, side: str, total: float | None) -> dict[str, Any]:
    return {"pair": pair, "side": side, "figures": None if total is None else {"total_img_s": total}}


def test_compare_every_pair_and_the_goal() -> None:
    compare = _driver().compare
    met = compare([_run(0, "hvd", 2200.0), _run(0, "ddp", 2000.0), _run(1, "ddp", 1000.0), _run(1, "hvd", 1100.0)],
                  fp16=False)  # fmt: skip
    assert [p["ratio"] for p in met["pairs"]] == [pytest.approx(1.1), pytest.approx(1.1)]
    assert met["goal"]["met"] is True and met["goal"]["pairs_reaching"] == 2
    one_short = compare([_run(0, "hvd", 2400.0), _run(0, "ddp", 2000.0), _run(1, "ddp", 2000.0),
                         _run(1, "hvd", 2100.0)], fp16=False)  # fmt: skip
    assert one_short["goal"]["met"] is False and one_short["goal"]["pairs_reaching"] == 1
    failed = compare([_run(0, "hvd", None), _run(0, "ddp", 2000.0)], fp16=False)
    assert failed["pairs"][0]["ratio"] is None and failed["goal"]["met"] is False
    assert compare([_run(0, "hvd", 3000.0), _run(0, "ddp", 2000.0)], fp16=True)["goal"]["met"] is None


def _suite(tmp_path: Path) -> Path:
    suite = tmp_path / "suite"
    (suite / SUITE_SCRIPT).parent.mkdir(parents=True)
    (suite / SUITE_SCRIPT).write_text("")
    return suite


def test_main_on_canned_runs_writes_the_json_and_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    driver = _driver()
    totals = iter([(1100.0, 1000.0), (1000.0, 1000.0), (990.0, 1000.0), (1200.0, 1300.0)])  # per run: iterations
    launched: list[list[str]] = []

    def launch(command: list[str], env: dict[str, str], timeout: float) -> tuple[int, float, str]:
        launched.append(command)
        if len(launched) == 3:
            return 1, 2.0, "Traceback (most recent call last):\nRuntimeError: boom\n"
        return 0, 1.5, _output(list(next(totals)))

    monkeypatch.setattr(driver, "_launch", launch)
    monkeypatch.setattr(driver, "_torchvision", lambda args, env: (True, "0.26.0"))
    out = tmp_path / "r" / "synthetic.json"
    status = driver.main(["--suite", str(_suite(tmp_path)), "--runs", "2", "--launcher", "mpirun --bind-to none",
                          "-n", "2", "--json", str(out)])  # fmt: skip
    assert status == 1  # a run failed
    sides = ["mpigpu.run" if "mpigpu.run" in c else "mpigpu.bench.synthetic" for c in launched]
    assert sides == ["mpigpu.run", "mpigpu.bench.synthetic", "mpigpu.bench.synthetic", "mpigpu.run"]
    assert launched[0][:4] == ["mpirun", "--bind-to", "none", "-n"] and "--model=resnet50" in launched[0]
    doc = json.loads(out.read_text())
    assert [(r["pair"], r["side"]) for r in doc["runs"]] == [(0, "hvd"), (0, "ddp"), (1, "ddp"), (1, "hvd")]
    assert [r["figures"]["total_img_s"] if r["figures"] else None for r in doc["runs"]] == [2100.0, 2000.0, None,
                                                                                           1990.0]  # fmt: skip
    assert doc["runs"][2]["problem"] == "FAILED: exit status 1" and "RuntimeError: boom" in doc["runs"][2]["output"]
    assert doc["pairs"][0]["ratio"] == pytest.approx(1.05) and doc["pairs"][1]["ratio"] is None
    assert doc["goal"] == {"ratio": 1.1, "every_pair": True, "float32_only": True, "pairs_reaching": 0, "met": False}
    assert doc["ok"] is False and doc["ranks"] == 2 and doc["torchvision"] == "0.26.0"
    assert doc["options"]["batch_size"] == 32 and "torch" in doc["versions"] and "hostname" in doc["machine"]
    assert doc["command"][1:4] == [str(DRIVER), "--suite", str(tmp_path / "suite")]
    printed = capsys.readouterr().out
    assert "   1  hvd,ddp        2100.0 +-196.0         2000.0 +-0.0    1.050" in printed, printed
    assert "FAILED rc=1" in printed and "#   | RuntimeError: boom" in printed
    assert printed.rstrip().endswith("# FAIL: 3 of 4 runs completed; hvd/ddp per pair 1.050, -; goal >= 1.1 in "
                                     "every pair: NOT met")  # fmt: skip


def test_main_without_the_suite_says_how_to_make_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _driver().main(["--suite", str(tmp_path / "none")]) == 2
    assert "scripts/hvd-suite.sh HOROVOD_CHECKOUT prepares it" in capsys.readouterr().err


def test_hvd_suite_copies_the_benchmark_unchanged(tmp_path: Path) -> None:
    checkout = tmp_path / "horovod"
    files = {"test/parallel/test_torch.py": "# tests\n", "test/utils/common.py": "# common\n",
             "examples/pytorch/pytorch_synthetic_benchmark.py": "# the benchmark\nprint('img/sec')\n"}  # fmt: skip
    for name, text in files.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(text)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "hvd-suite.sh"), str(checkout), str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for name, text in files.items():
        assert (tmp_path / "s" / name).read_text() == text
    assert (tmp_path / "s" / "horovod" / "torch" / "__init__.py").is_file()


def test_the_gpu_check_stage_passes_options_the_driver_takes() -> None:
    """gpu-check's hvd_synth stage cannot run here: its command line is read with the driver's own parser,
    so a misspelt option fails here and not on the GPU machine."""
    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    stage = script[script.index("stage_hvd_synth() {") :]
    stage = stage[: stage.index("\n}\n")]
    command = stage.split("scripts/hvd_synthetic.py", 1)[1].rsplit('"', 1)[0].replace("\\\n", " ")
    command = re.sub(r"\$\{?\w+\}?|\$\([^)]*\)", "v", command)
    args = _driver()._parser().parse_args(shlex.split(command))
    assert (args.runs, args.ranks, args.model, args.batch_size) == (2, 2, "resnet50", 32)
    assert (args.num_warmup_batches, args.num_batches_per_iter, args.num_iters) == (5, 10, 5)
    assert not args.fp16_allreduce and not args.no_cuda and args.json is not None and args.launcher == "v"
    assert "HVD_SYNTH_LIMIT" in stage, "the stage's time limit is a variable"


# -- on the host, launched for real -------------------------------------------------------------------
@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a stand-in ``torchvision`` whose ``models.tiny`` takes 3 x 224 x 224 images to 1000 classes."""
    folder = tmp_path_factory.mktemp("stand_in")
    (folder / "torchvision").mkdir()
    (folder / "torchvision" / "__init__.py").write_text('__version__ = "test stand-in"\n')
    (folder / "torchvision" / "models.py").write_text(
        "import torch\n\n\ndef tiny():\n"
        "    return torch.nn.Sequential(torch.nn.AvgPool2d(28), torch.nn.Flatten(), torch.nn.Linear(192, 1000))\n"
    )
    return folder


def _pythonpath(*front: Path) -> dict[str, str]:
    rest = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return {"PYTHONPATH": os.pathsep.join([*map(str, front), str(ROOT), *rest])}


def _horovod_suite(tmp_path: Path) -> tuple[Path, str]:
    """The suite folder and what its benchmark is: Horovod's from HOROVOD_CHECKOUT, else a copy of the DDP side."""
    suite = tmp_path / "suite"
    checkout = os.environ.get("HOROVOD_CHECKOUT")
    if checkout:
        done = subprocess.run(["bash", str(ROOT / "scripts" / "hvd-suite.sh"), checkout, str(suite)],
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return suite, "Horovod's"
    (suite / SUITE_SCRIPT).parent.mkdir(parents=True)
    shutil.copy(ROOT / "mpigpu" / "bench" / "synthetic.py", suite / SUITE_SCRIPT)
    return suite, "stand-in"


def test_driver_end_to_end_at_two_ranks(stand_in: Path, tmp_path: Path) -> None:
    suite, which = _horovod_suite(tmp_path)
    out = tmp_path / "synthetic.json"
    done = subprocess.run(
        [sys.executable, str(DRIVER), "--suite", str(suite), "--runs", "1", "--launcher", mpiexec(), "-n", "2",
         "--timeout", "100", "--json", str(out), *TINY],
        capture_output=True, text=True, timeout=240, env={**os.environ, **_pythonpath(stand_in)}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"({which} benchmark)\n" + done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert [r["side"] for r in doc["runs"]] == ["hvd", "ddp"] and doc["ok"] is True
    assert all(r["figures"]["ranks"] == 2 and len(r["figures"]["iter_img_s"]) == 2 for r in doc["runs"])
    assert doc["pairs"][0]["ratio"] > 0 and doc["torchvision"] == "test stand-in"
    assert "# PASS: 2 of 2 runs completed" in done.stdout
    ddp = "\n".join(doc["runs"][1]["output"])  # the DDP side: its header, and rank 0 alone prints the figures
    assert "# DDP, torch.distributed gloo" in ddp and "torchvision test stand-in tiny" in ddp
    assert ddp.count("Total img/sec") == 1 and ddp.count("Iter #") == 2


@pytest.fixture(scope="module")
def no_torchvision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose ``torchvision`` cannot be imported, as where it is not installed."""
    folder = tmp_path_factory.mktemp("no_torchvision")
    (folder / "torchvision").mkdir()
    (folder / "torchvision" / "__init__.py").write_text("raise ImportError(\"No module named 'torchvision'\")\n")
    return folder


def test_without_torchvision_the_driver_stops_before_any_run(no_torchvision: Path, tmp_path: Path) -> None:
    env = {**os.environ, **_pythonpath(no_torchvision)}
    done = subprocess.run([sys.executable, str(DRIVER), "--suite", str(_suite(tmp_path)), "--launcher", "false"],
                          capture_output=True, text=True, timeout=120, env=env, check=False)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "both sides need torchvision.models.resnet50" in done.stderr and "pip install torchvision" in done.stderr
    assert "# run" not in done.stdout


def test_without_torchvision_the_ddp_side_refuses_on_every_rank(no_torchvision: Path) -> None:
    done = run_mpi(2, ["-m", "mpigpu.bench.synthetic"], timeout=120, env=_pythonpath(no_torchvision))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("torchvision cannot be imported here") == 1 and "Traceback" not in done.stderr
