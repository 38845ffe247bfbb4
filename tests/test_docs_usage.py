"""docs/usage.md's thread-per-device example runs as written on a machine without GPUs (issue 39: it
built ``f"cuda:{gpu}"`` from ``on_device``, which yields None for a host device: ``'cuda:None'``)."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, gpu_count, run_mpi

DOC = ROOT / "docs" / "usage.md"


def _example(first_line: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"the example starting {first_line!r} is not in docs/usage.md"
    return found[0]


def test_thread_per_device_example_runs_on_host_devices(tmp_path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    if gpu_count():
        pytest.skip("this machine has GPUs: the example's host-device form runs where there is none")
    script = tmp_path / "threads.py"
    script.write_text(_example("# threads.py"))
    result = run_mpi(2, [str(script)], timeout=240, env={"MPIGPU_DEVICES_PER_RANK": "2"})
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    # 2 ranks x 2 host devices, device i filled with i: the mean is 0.5 on every participant; a line per rank
    assert result.stdout.count("[(0, 0.5), (1, 0.5)]") == 2, text
