"""Issue 12, section 2, as whole jobs: scenarios that hang, abort or pair calls wrongly when broken,
each in its own mpiexec with a time limit (tests/conftest.py:run_mpi). Threads submitting to one
communicator at once, a never-waited failing handle (plain and under ``python -m mpigpu.run``),
settings that differ on one rank of an MPMD launch, NCCL creation failing on one rank (a fake NCCL
module, so it runs without a GPU)."""

from __future__ import annotations

import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import run_mpi

LIMIT_S = 60  # run_mpi's hang detector
END_WITHIN_S = 10  # one rank's failure ends the job within this


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(text))
    return path


# -- several threads submitting to one communicator -------------------------------------------------
THREADS = """
import sys, threading
import numpy as np
import mpigpu
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.core._mpi import world

comm = world()
rank, n = comm.Get_rank(), comm.Get_size()
CALLS = 50
counts = {"ok": 0, "wrong": 0, "refused": 0, "mismatch": 0}
lock = threading.Lock()
start = threading.Barrier(4)

def submit() -> None:
    start.wait()
    handles = []
    for k in range(CALLS):  # call k holds rank + k: paired with call k elsewhere, the sum is exact
        x = np.full(1000, float(rank + k))
        try:
            handles.append((k, x, mpigpu.allreduce_async(x, "sum", backend="cpu")))
        except InvalidArgument:
            with lock:
                counts["refused"] += 1
    for k, x, handle in handles:
        try:
            handle.wait()
        except MismatchError:
            with lock:
                counts["mismatch"] += 1
            continue
        with lock:
            counts["ok" if np.all(x == n * (n - 1) / 2 + n * k) else "wrong"] += 1

threads = [threading.Thread(target=submit) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
sys.stdout.write(f"rank {rank}: " + " ".join(f"{k}={v}" for k, v in counts.items()) + "\\n")
"""


@pytest.mark.parametrize("n", [2, 4])
def test_threads_submitting_at_once_never_pair_wrongly(tmp_path: Path, n: int) -> None:
    """The issue's scenario (4 threads, allreduce_async at once): 191 of 200 results were wrong,
    silently. Now every call is either exact or refused with an error, on every rank."""
    result = run_mpi(n, [str(_script(tmp_path, THREADS))], timeout=LIMIT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = re.findall(r"rank \d+: ok=(\d+) wrong=(\d+) refused=(\d+) mismatch=(\d+)", result.stdout)
    assert len(lines) == n, output
    for ok, wrong, refused, mismatch in lines:
        assert int(wrong) == 0, output
        assert int(refused) >= 3 * 50, f"the three threads that do not own the communicator are refused\n{output}"
        assert int(ok) + int(wrong) + int(refused) + int(mismatch) == 200


# -- a handle that is never waited -----------------------------------------------------------------
NEVER_WAITED = """
import sys
import numpy as np
import mpigpu
from mpigpu.core._mpi import world
from mpigpu.backends.cpu import CpuBackend

rank = world().Get_rank()
if rank == 1:
    def broken(self, x, out, op):  # the launch every allreduce runs (its call record's)
        def launch(*args):
            raise RuntimeError("injected failure on rank 1")
        return launch
    CpuBackend.bind_allreduce = broken
handle = mpigpu.allreduce_async(np.ones(100_000), backend="cpu")  # never waited
print(f"rank {rank} exiting", flush=True)
"""


@pytest.mark.parametrize("runner", [[], ["-m", "mpigpu.run"]], ids=["plain", "mpigpu.run"])
def test_a_never_waited_failure_ends_the_job_with_its_message(tmp_path: Path, runner: list[str]) -> None:
    """Seen: the failing rank printed nothing, both ranks said they were exiting, and the job hung."""
    start = time.monotonic()
    result = run_mpi(2, [*runner, str(_script(tmp_path, NEVER_WAITED))], timeout=LIMIT_S)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert elapsed < END_WITHIN_S + 5, f"took {elapsed:.1f} s\n{output}"
    assert "[mpigpu rank 1]" in output and "RuntimeError: injected failure on rank 1" in output, output
    assert "allreduce_async queued on this communicator failed on this rank" in output, output


# -- settings that differ on one rank (MPMD launch) --------------------------------------------------
SETTINGS = """
import numpy as np
import mpigpu
x = np.ones(10)
mpigpu.allreduce(x, "sum")
print("sum", x[0], flush=True)
"""


@pytest.mark.parametrize(("variable", "value"), [("MPIGPU_CHECK", "0"), ("MPIGPU_NODE_SIZE", "1")])
def test_one_rank_with_a_different_setting_ends_the_job(tmp_path: Path, variable: str, value: str) -> None:
    """Seen: MPIGPU_CHECK=0 on one rank gave 0.5 instead of 1.5 and a hang; a different
    MPIGPU_NODE_SIZE hung at start-up. Now: a ConfigError naming the variable and the values."""
    script = str(_script(tmp_path, SETTINGS))
    args = [script, ":", "-n", "1", "env", f"{variable}={value}", sys.executable, script]
    start = time.monotonic()
    result = run_mpi(2, args, timeout=LIMIT_S)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert elapsed < END_WITHIN_S + 5, f"took {elapsed:.1f} s\n{output}"
    assert "ConfigError: settings differ between ranks" in output, output
    assert f"{variable}: " in output and f"{value} on rank 2" in output, output
    assert "sum" not in result.stdout, "no rank went on to reduce"


# -- NCCL creation failing on one rank (fake NCCL: no GPU needed) ------------------------------------
FAKE_NCCL = """
import sys, types
from mpigpu.core._mpi import world
from mpigpu.core.errors import BackendUnavailable, MismatchError

case = sys.argv[1]
comm = world().Dup()
rank = comm.Get_rank()
destroyed = []

class NcclError(Exception):
    pass

class NcclCommunicator:
    def __init__(self, size, uid, r):
        assert uid == b"unique-id", uid
        if case == "init" and r == 1:
            raise NcclError("ncclCommInitRank failed: unhandled system error")
    def destroy(self):
        destroyed.append(rank)

def get_unique_id():
    if case == "uid":
        raise NcclError("ncclGetUniqueId failed: no network interface")
    return b"unique-id"

nccl = types.ModuleType("cupy.cuda.nccl")
nccl.NcclError, nccl.NcclCommunicator, nccl.get_unique_id = NcclError, NcclCommunicator, get_unique_id
cuda = types.ModuleType("cupy.cuda")
cuda.nccl = nccl
cupy = types.ModuleType("cupy")
cupy.cuda = cuda
sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl})

from mpigpu.backends.nccl import NcclBackend

ctx = types.SimpleNamespace(comm=comm, rank=rank, size=comm.Get_size(), activate_gpu=lambda: None)
try:
    NcclBackend(ctx)
    outcome = "created"
except (BackendUnavailable, MismatchError) as exc:
    outcome = f"{type(exc).__name__}: {exc}".replace("\\n", " ")
sys.stdout.write(f"rank {rank}: {outcome} | destroyed={rank in destroyed}\\n")  # one write: no interleaving
"""


@pytest.mark.parametrize(("case", "failing"), [("uid", 0), ("init", 1)])
def test_nccl_creation_failing_on_one_rank_reaches_every_rank(tmp_path: Path, case: str, failing: int) -> None:
    """uid: rank 0 cannot get the unique id (the others waited in the broadcast, then in NCCL's
    init); init: one rank's ncclCommInitRank fails after the others' succeeded."""
    result = run_mpi(3, [str(_script(tmp_path, FAKE_NCCL)), case], timeout=LIMIT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = dict(re.findall(r"rank (\d+): (.*)", result.stdout))
    assert sorted(lines) == ["0", "1", "2"], output
    for rank, line in lines.items():
        if int(rank) == failing:
            assert line.startswith("BackendUnavailable: NCCL could not"), output
        else:
            assert line.startswith("MismatchError: nccl backend:") and f"rank {failing} failed" in line, output
            if case == "init":
                assert line.endswith("destroyed=True"), f"a rank whose init succeeded frees its communicator\n{output}"
