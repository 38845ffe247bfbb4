"""``python -m mpigpu.cleanup`` (mpigpu.job.mpich_shm.leftovers): in a private directory standing in for
/dev/shm, a gone job's MPICH file is removed; a file another process maps or holds open (a live job's),
a young one (a job starting), a symlink and its target, a file others may open, another user's and
files not MPICH's are all kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpigpu.cleanup import main

OLD = time.time() - 3600


def _file(directory: Path, name: str, mode: int = 0o600, old: bool = True) -> Path:
    path = directory / name
    path.write_bytes(b"\0" * 4096)
    path.chmod(mode)
    if old:
        os.utime(path, (OLD, OLD))
    return path


HOLD = """
import mmap, sys, time
mapped = open(sys.argv[1], "r+b")
view = mmap.mmap(mapped.fileno(), 0)
mapped.close()  # the mapping alone keeps it in use
held = open(sys.argv[2], "rb")  # open, not mapped
print("ready", flush=True)
time.sleep(120)
"""


def test_only_a_gone_jobs_file_is_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    dead = _file(shm, "mpich_shm_0dead_0")
    mapped = _file(shm, "mpich_shm_11ve_0")
    held = _file(shm, "mpich_shm_11ve_1")
    keep = [mapped, held, _file(shm, "mpich_shm_young_0", old=False), _file(shm, "mpich_shm_shared_0", 0o644)]
    keep.append(_file(shm, "not_mpich_0"))
    outside = _file(tmp_path, "mpich_shm_target_0")
    (shm / "mpich_shm_link_0").symlink_to(outside)
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(mapped), str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert main(["--dir", str(shm), "--dry-run"]) == 0
        assert dead.exists(), "--dry-run removes nothing"
        assert f"would remove {shm}/{dead.name}" in capsys.readouterr().out
        assert main(["--dir", str(shm)]) == 0
    finally:
        child.kill()
        child.wait()
    out = capsys.readouterr().out
    assert not dead.exists() and f"removed {shm}/{dead.name}" in out and "# removed 1 file of jobs" in out, out
    assert all(path.exists() for path in keep), [p.name for p in keep if not p.exists()]
    assert (shm / "mpich_shm_link_0").is_symlink() and outside.exists(), "a symlink is neither followed nor removed"
    # once the holder is gone, its two files are a gone job's too
    assert main(["--dir", str(shm)]) == 0
    assert not mapped.exists() and not held.exists() and "# removed 2 files" in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_another_users_file_is_never_touched(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    theirs = _file(shm, "mpich_shm_theirs_0")
    os.chown(theirs, 65534, 65534)
    os.utime(theirs, (OLD, OLD))
    assert main(["--dir", str(shm), "--min-age", "0"]) == 0
    assert theirs.exists()


LIVE = """
import os, sys, time
from mpi4py import MPI
segments = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/dev/shm/mpich" in line})
pids = MPI.COMM_WORLD.allgather(os.getpid())
if MPI.COMM_WORLD.Get_rank() == 0:
    os.write(1, f"segments {' '.join(segments)}\\n".encode())
    if sys.argv[1] == "kill":  # kill -9 of every rank (this one last): none can clean up
        for pid in pids[1:] + pids[:1]:
            os.kill(pid, 9)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
MPI.COMM_WORLD.Barrier()
"""


def test_a_killed_mpich_jobs_file_is_found_and_a_running_jobs_is_not(tmp_path: Path) -> None:
    """Real MPICH jobs (the venv's hydra): one whose ranks were killed leaves its /dev/shm file, which
    leftovers() finds; a running job's file is not found. Only the killed job's file is removed here
    (other users' and other jobs' files in /dev/shm are left as they are)."""
    from conftest import mpiexec

    from mpigpu.job.mpich_shm import leftovers, remove

    if "HYDRA" not in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout:
        pytest.skip("needs MPICH's hydra launcher (MPICH's /dev/shm files)")
    script, stop = tmp_path / "live.py", tmp_path / "stop"
    script.write_text(LIVE)

    def start(mode: str) -> tuple[subprocess.Popen[str], str]:
        job = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, str(script), mode, str(stop)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
        assert job.stdout is not None
        line = job.stdout.readline()
        assert line.startswith("segments /dev/shm/mpich"), line
        return job, line.split()[1]

    killed, dead_file = start("kill")
    killed.wait(timeout=60)
    live, live_file = start("live")
    try:
        deadline = time.monotonic() + 30  # a killed rank's memory is unmapped a moment after mpiexec returns
        while True:
            names = {leftover.name: leftover for leftover in leftovers("/dev/shm", min_age_s=0)[0]}
            if Path(dead_file).name in names or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert Path(dead_file).name in names, f"the killed job's {dead_file} not found"
        assert Path(live_file).name not in names, f"the running job's {live_file} was called gone"
        assert remove("/dev/shm", [names[Path(dead_file).name]]) and not Path(dead_file).exists()
    finally:
        stop.touch()
        live.wait(timeout=60)
