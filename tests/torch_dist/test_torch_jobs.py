"""Whole jobs over the "mpigpu" backend, as a user launches them: import starts nothing, the plain
``init_process_group`` under mpiexec across MPI's nodes (the TCPStore rendezvous), a timeout given to
``init_process_group`` ends a stuck job, a dying rank ends the job."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import mpiexec, run_mpi

pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

LIMIT_S = 120

PLAIN = """
import sys
import torch
import torch.distributed as dist
import mpigpu.torch

dist.init_process_group(sys.argv[1])
r, n = dist.get_rank(), dist.get_world_size()
t = torch.arange(5, dtype=torch.float64) + r
dist.all_reduce(t)
assert torch.equal(t, torch.arange(5, dtype=torch.float64) * n + n * (n - 1) / 2), t
store = dist.distributed_c10d._get_default_store()
while isinstance(store, dist.PrefixStore):
    store = store.underlying_store
sys.stdout.write(f"store {type(store).__name__}\\n")  # one write each: the two ranks' lines never interleave
sys.stdout.flush()
dist.destroy_process_group()
sys.stdout.write(f"OK {r}\\n")
sys.stdout.flush()
"""


def test_importing_mpigpu_torch_starts_no_mpi() -> None:
    code = "import sys, mpigpu.torch, torch.distributed as d; assert 'mpi4py.MPI' not in sys.modules; print(d.Backend.MPIGPU)"  # noqa: E501
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LIMIT_S, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "mpigpu", done.stderr


@pytest.mark.parametrize("backend", ["mpigpu", "gloo"])
def test_plain_init_across_two_nodes_rendezvous_over_tcp(tmp_path: Path, backend: str) -> None:
    """MPICH's fork launcher with named hosts: two MPI nodes, so the store is rank 0's TCPStore."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    command = [mpiexec(), "-launcher", "fork", "-hosts", "nodeA:1,nodeB:1", "-n", "2", sys.executable, str(script)]
    done = subprocess.run([*command, backend], capture_output=True, text=True, timeout=LIMIT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK 0" in done.stdout and "OK 1" in done.stdout
    assert done.stdout.count("store TCPStore") == 2, done.stdout


def test_plain_init_on_one_node_rendezvous_in_a_private_file_store(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    done = run_mpi(2, [str(script), "mpigpu"], timeout=LIMIT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("store FileStore") == 2, done.stdout


STUCK = """
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import mpigpu.torch

dist.init_process_group("mpigpu", timeout=timedelta(seconds=3))
if dist.get_rank() == 1:
    if sys.argv[1] == "dies":
        os._exit(3)
    time.sleep(60)  # never calls: rank 0 waits in all_reduce
dist.all_reduce(torch.ones(4))
print("not reached", flush=True)
"""


@pytest.mark.parametrize(("how", "status", "says"), [("stuck", 124, "CollectiveTimeout"), ("dies", None, "")])
def test_a_stuck_or_dying_rank_ends_the_job(tmp_path: Path, how: str, status: int | None, says: str) -> None:
    """A rank that never calls: the 3 s given to init_process_group ends the job (exit 124, as
    MPIGPU_TIMEOUT does). A rank that dies: the job ends (mpiexec's or mpigpu's own ending)."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    started = time.monotonic()
    done = run_mpi(2, [str(script), how], timeout=LIMIT_S)
    elapsed = time.monotonic() - started
    assert done.returncode != 0 and "not reached" not in done.stdout, done.stdout + done.stderr
    if status is not None:
        assert status in (done.returncode, done.returncode - 128) or says in done.stderr, done.stderr
        assert says in done.stdout + done.stderr
    assert elapsed < 50, f"the job took {elapsed:.0f} s to end"
