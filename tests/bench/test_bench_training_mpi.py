"""``python -m mpigpu.bench.training`` under mpiexec (2 ranks, host, gloo as the DDP anchor): the
training-step table and JSON, every mpigpu row (BackwardAverager with its default buckets: a small
first one, as DDP's; hvd.DistributedOptimizer) within the DDP tolerance of samples/torch_data_parallel.py
(1e-5 x max |p|) while the row without averaging is not, DDP's run-to-run noise 0 on the host, and
the verdict (tolerance, or DDP's own noise); ResNet-50 and GPT-2 without torchvision and
transformers (hidden by the test, so it holds where they are installed too): refused when named,
skipped under ``--model all``; the fusion and accuracy sections. Serial tests: each launches mpiexec."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import ROOT, run_mpi

from mpigpu.bench.training import _model_list, _Row, _verdict, paired_overhead, round_order
from mpigpu.cli import launcher_rank

pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

ROWS = {"none", "ddp", "ddp_repeat", "backward_averager", "averager_after", "distributed_optimizer"}
AVERAGING = {"backward_averager", "averager_after", "distributed_optimizer"}


def _hide(tmp_path: Path, *packages: str) -> dict[str, str]:
    """An environment in which importing ``packages`` raises ImportError, as when not installed."""
    tmp_path.mkdir(exist_ok=True)
    for name in packages:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is hidden by the test')\n")
    return {"PYTHONPATH": f"{tmp_path}:{ROOT}"}


def _ok(done, *expected: str) -> None:
    text = f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, text
    for line in expected:
        assert line in done.stdout, text


def test_model_list() -> None:
    assert _model_list("mlp,gpt2") == ["mlp", "gpt2"]
    assert _model_list("all") == ["all"]
    for bad in ("vgg", "all,mlp", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            _model_list(bad)


def test_training_step_matches_ddp_and_skips_missing_models(tmp_path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    out = tmp_path / "training.json"
    env = _hide(tmp_path / "hidden", "torchvision", "transformers")
    args = ["-m", "mpigpu.bench.training", "--device", "cpu", "--skip", "fusion", "--model", "all",
            "--width", "256", "--depth", "6", "--batch", "8", "--iters", "3", "--warmup", "2", "--rounds", "3",
            "--bucket-bytes", "512K", "--json", str(out)]  # fmt: skip
    done = run_mpi(2, args, timeout=600, env=env)
    _ok(done, "# training step: resnet50 skipped: --model resnet50 needs torchvision",
        "# training step: gpt2 skipped: --model gpt2 needs transformers", "DDP (gloo, defaults)",
        "BackwardAverager, 2 bucket(s)", "Averager after backward, 6 bucket(s)",
        "hvd.DistributedOptimizer, 2 bucket(s)", "DDP again (its run-to-run noise)",
        "hidden by BackwardAverager", "DDP's run-to-run noise 0.00e+00")  # fmt: skip
    document = json.loads(out.read_text())
    assert len(document["skipped"]) == 2
    [step] = document["training"]
    assert step["model"] == "mlp" and step["parameters"] == 6 * (256 * 256 + 256)
    # BackwardAverager's defaults (DDP's): the 6 layers (257 KiB each) in a first bucket of <= 1 MiB
    # (the last 3 layers) and one of <= 25 MiB; the Averager after backward: one layer per 512K bucket
    assert step["buckets"] == {"backward_averager": 2, "averager_after": 6, "distributed_optimizer": 2}
    assert set(step["seconds"]) == ROWS and all(s > 0 for s in step["seconds"].values())
    # interleaved rounds: every row timed in each of the 3 rounds; the median and spread are the rounds'
    assert step["steps"] == {"warmup": 2, "rounds": 3, "per_round": 3, "timed": 9,
                             "order": "rows alternately forward and backward per round"}  # fmt: skip
    for row in ROWS:
        rounds = step["round_seconds"][row]
        assert len(rounds) == 3 and all(r > 0 for r in rounds)
        assert step["seconds"][row] == pytest.approx(sorted(rounds)[1])
        assert step["spread_seconds"][row] == [min(rounds), max(rounds)]
    # the cost over no communication: per round, the row's time minus no communication's in that round;
    # their median and spread
    for row in ROWS:
        paired = [t - b for t, b in zip(step["round_seconds"][row], step["round_seconds"]["none"], strict=True)]
        assert step["round_overhead_s"][row] == pytest.approx(paired)
        assert step["overhead_s"][row] == pytest.approx(sorted(paired)[1])
        assert step["overhead_spread_s"][row] == pytest.approx([min(paired), max(paired)])
    assert step["overhead_s"]["none"] == 0.0
    assert step["communication_s"] == step["overhead_s"]["averager_after"]
    assert "hidden_fraction" in step and set(step["overhead_vs_ddp"]) == AVERAGING
    # issue 48: the GPU-clock figures need a GPU; here the key is there, null, with the reason
    assert step["gpu_overhead_s"] is None and "no GPU" in step["gpu_clock"], step["gpu_clock"]
    assert "GPU clock: none (no GPU" in done.stdout
    diff, tolerance = step["max_param_difference"], step["tolerance"]
    assert tolerance == pytest.approx(1e-5 * step["param_scale"]) and step["param_scale"] > 0.05
    # gloo and the CPU kernels are deterministic: DDP trained twice is bitwise the same (noise floor 0),
    # so every mpigpu row passes on the tolerance alone, and hvd.DistributedOptimizer's row is there
    assert diff["ddp"] == 0.0 and diff["ddp_repeat"] == 0.0 and step["ddp_noise"] == 0.0
    assert all(diff[row] <= tolerance for row in AVERAGING)
    assert step["verified"] == dict.fromkeys(AVERAGING, True)
    assert step["verified_by"] == dict.fromkeys(AVERAGING, "tolerance") and step["deterministic"] is False
    # the check can fail: each rank trains on its own data, so not averaging moves the parameters
    assert diff["none"] > 100 * tolerance


def test_rounds_alternate_forward_and_backward() -> None:
    rows = ("a", "b", "c")
    assert [round_order(rows, i) for i in range(3)] == [rows, ("c", "b", "a"), rows]


def test_deterministic_verdict_is_bitwise_and_needs_ddp_equal_to_itself() -> None:
    """Issue 37: with deterministic kernels the check cannot pass or fail by chance: 0 or nothing."""
    assert _verdict(0.0, tolerance=1e-6, noise=0.0, deterministic=True) == "bitwise"
    assert _verdict(1e-12, tolerance=1e-6, noise=0.0, deterministic=True) is None  # within tolerance: not enough
    assert _verdict(0.0, tolerance=1e-6, noise=1e-9, deterministic=True) is None  # determinism not achieved
    assert _verdict(float("nan"), tolerance=1e-6, noise=0.0, deterministic=True) is None


def test_each_row_draws_its_own_random_numbers_when_interleaved() -> None:
    """Rows share torch's global generator; interleaved, each row's k-th step must still draw the dropout masks
    DDP's k-th step draws, or parameters cannot match bitwise. Two identical rows of a model with dropout,
    stepped in different interleavings, end bitwise equal (one shared generator would make them differ)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    from mpi4py import MPI

    from mpigpu.bench.models import TrainingModel

    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    inputs = (torch.randn(8, 16),)
    made = TrainingModel("drop", "dropout MLP", module, inputs, lambda m, x: m(x[0]).square().mean())
    args = argparse.Namespace(seed=0, lr=0.1, set_to_none=False, backend="auto", bucket_bytes=1 << 20,
                              overlap_bucket_bytes=1 << 20)  # fmt: skip
    first, second = (_Row("none", made, args, MPI.COMM_SELF, on_gpu=False) for _ in range(2))
    first.steps(2)
    second.steps(1)
    torch.rand(100)  # someone else draws from the global generator meanwhile
    first.steps(1)
    second.steps(2)
    for p, q in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)
    lone = _Row("none", made, args, MPI.COMM_SELF, on_gpu=False)
    torch.manual_seed(0)  # control: a generator advanced by another row's draws gives other masks, other parameters
    torch.rand(100)
    lone._rng = torch.get_rng_state()
    lone.steps(3)
    assert any(not torch.equal(p, q) for p, q in zip(first.model.parameters(), lone.model.parameters(), strict=True))


def test_deterministic_run_is_bitwise_on_the_host(tmp_path) -> None:
    """--deterministic: every mpigpu row ends with exactly DDP's parameters (gloo and the CPU kernels), and
    the table says the check is bitwise."""
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    out = tmp_path / "det.json"
    args = ["-m", "mpigpu.bench.training", "--device", "cpu", "--skip", "fusion", "--model", "mlp", "--width", "64",
            "--depth", "3", "--batch", "4", "--iters", "2", "--warmup", "1", "--rounds", "2", "--deterministic",
            "--json", str(out)]  # fmt: skip
    done = run_mpi(2, args, timeout=600)
    _ok(done, "ok (bitwise DDP's)", "the check is bitwise")
    [step] = json.loads(out.read_text())["training"]
    assert step["verified_by"] == dict.fromkeys(AVERAGING, "bitwise") and step["deterministic"] is True


def test_verdict_passes_on_the_tolerance_or_within_ddps_own_noise() -> None:
    assert _verdict(1e-7, tolerance=1e-6, noise=0.0) == "tolerance"
    assert _verdict(1e-6, tolerance=1e-6, noise=1e-3) == "tolerance"  # the tolerance is named first
    assert _verdict(2e-4, tolerance=1e-6, noise=3e-4) == "ddp_noise"
    assert _verdict(3e-4, tolerance=1e-6, noise=3e-4) == "ddp_noise"
    assert _verdict(4e-4, tolerance=1e-6, noise=3e-4) is None
    assert _verdict(float("inf"), tolerance=1e-6, noise=3e-4) is None
    assert _verdict(float("nan"), tolerance=1e-6, noise=float("nan")) is None


def test_a_named_missing_model_is_refused_with_status_2(tmp_path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    done = run_mpi(2, ["-m", "mpigpu.bench.training", "--device", "cpu", "--model", "mlp,resnet50"],
                   timeout=120, env=_hide(tmp_path, "torchvision"))  # fmt: skip
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stderr.count("error: --model resnet50 needs torchvision") == 1, done.stderr
    assert "pip install torchvision" in done.stderr and "Traceback" not in done.stderr
    assert "# fusion" not in done.stdout, "refused before measuring anything"


def test_fusion_and_accuracy(tmp_path) -> None:
    out = tmp_path / "training.json"
    args = ["-m", "mpigpu.bench.training", "--device", "cpu", "--skip", "step", "--scale", "0.005",
            "--iters", "2", "--warmup", "1", "--accuracy", "--json", str(out)]  # fmt: skip
    _ok(run_mpi(2, args, timeout=600), "Averager vs one allreduce per tensor", "Averager vs one flat allreduce",
        "compression accuracy")  # fmt: skip
    document = json.loads(out.read_text())
    fusion = document["fusion"]
    assert fusion["tensors"] == 161 and fusion["speedup_vs_per_tensor"] > 0
    assert set(fusion["seconds"]) >= {"per_tensor", "flat", "averager_copy", "averager_views"}
    accuracy = document["accuracy"]
    assert accuracy["float32"]["max_rel_error_per_tensor"] < 1e-6
    assert 0 < accuracy["bfloat16"]["rel_l2_error"] < 1e-2
    assert "training" not in document


def test_paired_overhead_cancels_a_slow_spell_that_falls_on_both_rows() -> None:
    # round 2 is slow for everybody (a shared machine's spell): the rows' own medians move by it, their
    # per-round differences do not
    rounds = {"none": [20.0, 20.5, 31.0], "row": [21.0, 21.5, 32.0]}
    assert paired_overhead(rounds) == {"none": [0.0, 0.0, 0.0], "row": [1.0, 1.0, 1.0]}
    with pytest.raises(ValueError):  # a row with a round missing is an error, not a shorter pairing
        paired_overhead({"none": [1.0, 2.0], "row": [1.0]})
