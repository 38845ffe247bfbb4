"""The GPU-only scripts on a machine without a GPU or CuPy: one line saying that they need a GPU and
the CUDA extra, and exit status 2, instead of a ModuleNotFoundError traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, gpu_available

SCRIPTS = [
    ["scripts/ipc_latency.py"],
    ["scripts/ipc_sanitize_driver.py"],
    ["scripts/call_cost.py", "--framework", "cupy"],
    ["scripts/call_cost.py", "--framework", "torch"],
]


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU: the scripts run")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: " ".join(s)[8:])
def test_gpu_script_without_a_gpu_says_what_it_needs(script: list[str]) -> None:
    done = subprocess.run([sys.executable, *script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{script[0]} needs a CUDA GPU and the CUDA extra" in done.stderr, done.stderr
    # both CUDA extras, installable without a package index that carries mpigpu: the packages, or the clone's extra
    assert "pip install cupy-cuda12x" in done.stderr and "'.[cuda12]'" in done.stderr, done.stderr
    assert "pip install cupy-cuda13x" in done.stderr and "'.[cuda13]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
