"""scripts/jax_step_bench.py on JAX's CPU under mpiexec -n 2 (issue 23): every row runs and agrees, the
in-jit rows through mpigpu's FFI call, (s) mpigpu.jax.average_tree inside shard_map and (c) lax.pmean
through XLA's collectives, and the JSON carries the machine, the versions and the goals."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, run_mpi

pytest.importorskip("jax", reason="jax is not installed (the CI test script installs it)")


def test_step_bench_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "jax-step.json"
    args = [str(ROOT / "scripts" / "jax_step_bench.py"), "--device", "cpu", "--width", "32", "--depth", "2",
            "--steps", "3", "--warmup", "1", "--json", str(out)]  # fmt: skip
    result = run_mpi(2, args, timeout=240, env={"JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0 and "# PASS" in result.stdout, result.stdout + result.stderr
    document = json.loads(out.read_text())
    rows = document["results"]
    assert {"in_jit", "leave_jit", "local_only", "in_shard_map", "jax_distributed"} <= set(rows), rows
    assert rows["in_jit"]["backend"] == "cpu" and rows["in_jit"]["handler"]["calls_per_step"] == 1
    assert rows["in_shard_map"]["backend"] == rows["jax_distributed"]["backend"] == "XLA's CPU collectives"
    assert "handler" not in rows["in_shard_map"]  # no FFI call: XLA's own all-reduce
    for name in ("in_jit", "in_shard_map", "jax_distributed", "leave_jit"):
        assert rows[name]["identical_on_every_rank"] is True, name
    assert set(document["goals"]) == {"in_jit_vs_pmean", "in_shard_map_vs_pmean", "handler_cpu_us_per_call"}
    handler = document["handler"]  # issue 48: the in-jit handler per call; NCCL's enqueue beside it needs a GPU
    assert handler["us_per_call"] == rows["in_jit"]["handler"]["us_per_call"] > 0, handler
    assert handler["bytes_per_call"] == rows["in_jit"]["bytes_reduced_per_step"] > 0, handler
    assert handler["nccl_enqueue_us"] is None and "no GPU (JAX on cpu)" in handler["nccl_enqueue_reason"], handler
    goal = document["goals"]["handler_cpu_us_per_call"]
    assert goal["over_nccl_enqueue_us"] is None and goal["met"] is (handler["cpu_us_per_call"] <= 10.0), goal
    assert document["machine"]["nodes"] == 1 and document["versions"]["jaxlib"]
    assert document["skipped"] == {}


def test_local_devices_mode_on_two_host_devices(tmp_path) -> None:
    """--local-devices (one process, two of XLA's host devices): (s) and (c) through XLA's collectives, (sd)
    and (sdp) through mpigpu's FFI call once per device (issue 38; on host devices both on the Python
    handler), all ending with the same parameters."""
    out = tmp_path / "jax-step-local.json"
    args = [str(ROOT / "scripts" / "jax_step_bench.py"), "--local-devices", "--device", "cpu", "--width", "32",
            "--depth", "2", "--steps", "3", "--warmup", "1", "--json", str(out)]  # fmt: skip
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = run_mpi(1, args, timeout=240, env=env)
    assert result.returncode == 0 and "# PASS" in result.stdout, result.stdout + result.stderr
    document = json.loads(out.read_text())
    assert document["mode"] == "local_devices" and document["local_devices"] == 2 and document["ranks"] == 1
    assert document["skipped"] == {}
    rows = document["results"]
    assert set(rows) == {"in_shard_map", "jax_pmean", "per_device_ffi", "per_device_python"}, rows
    assert rows["in_shard_map"]["backend"] == rows["jax_pmean"]["backend"] == "XLA's CPU collectives"
    assert rows["per_device_ffi"]["backend"] == rows["per_device_python"]["backend"] == "cpu per device, python"
    assert all(r["identical_on_every_device"] and r["devices_holding_a_copy"] == 2 for r in rows.values()), rows
    assert document["goals"]["per_device_ffi_vs_pmean"]["target"] == 1.1
    assert all(r["max_abs_diff_vs_pmean"] <= 1e-6 for r in rows.values()), rows
    refused = run_mpi(2, args[:2], timeout=120, env=env)  # the mode drives one process's devices
    assert refused.returncode == 2 and "--local-devices runs in one process" in refused.stderr
