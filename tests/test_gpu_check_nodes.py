"""scripts/gpu-check.sh's ``nodes`` stage (issue 48, goal 6) where it can run without GPUs: the stage skips with
its reason on a machine of fewer than 2 GPUs, its verdicts on mpigpu.info's and NCCL's output accept what they
should and refuse the rest, and scripts/node-rank.sh gives each emulated node its own NCCL_HOSTID and each rank
its own GPU under MPICH's fork launcher with named hosts."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ROOT, mpiexec, outside_job_env

SCRIPT = ROOT / "scripts" / "gpu-check.sh"

INFO_TWO_NODES = """# mpigpu 0.1.0 | MPICH Version: 5.0.2 (MPI 5.0) | 2 ranks on 2 nodes | Python 3.12.3
Backends
  ipc            unavailable: the ranks span 2 nodes; CUDA IPC connects the GPUs of one node only
  nccl           available: NCCL 2.28.3
auto would pick (float32, avg)
  device    8 B  -> nccl  (rule: first usable of ipc, nccl (skipped ipc: the ranks span 2 nodes; ...))
"""


def _check(function: str, text: str, tmp_path) -> subprocess.CompletedProcess[str]:
    """Run one of gpu-check.sh's check functions (cut out of the script, as it is) on ``text``."""
    log = tmp_path / "log.txt"
    log.write_text(text)
    body = f'source <(sed -n "/^{function}() {{/,/^}}/p" "{SCRIPT}"); {function} "{log}"'
    return subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=30, check=False)


def test_info_check_accepts_two_nodes_with_ipc_refused(tmp_path) -> None:
    done = _check("nodes_info_check", INFO_TWO_NODES, tmp_path)
    assert done.returncode == 0 and "auto never ipc: PASS" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (("2 ranks on 2 nodes", "2 ranks on 1 node"), "mpigpu.info does not report 2 nodes"),
        (("unavailable: the ranks span 2 nodes", "available: CUDA IPC"), "ipc is not refused"),
        (("-> nccl  (rule", "-> ipc  (rule"), "auto picks ipc across nodes"),
    ],
)
def test_info_check_refuses_what_is_wrong(change: tuple[str, str], complaint: str, tmp_path) -> None:
    done = _check("nodes_info_check", INFO_TWO_NODES.replace(*change), tmp_path)
    assert done.returncode != 0 and f"FAIL: {complaint}" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("lines", "ok"),
    [
        (
            [
                "Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0",
                "Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0",
            ],
            True,
        ),
        (["Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA"], True),
        (["Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read", "Channel 01/0 : 0[0] -> 1[1] via NET/Socket/0"], False),
        (["Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct"], False),
        (["# PASS: 0 wrong elements over 2 ranks"], False),  # no NCCL log at all: nothing shows the transport
    ],
)
def test_transport_check_wants_net_and_nothing_else(lines: list[str], ok: bool, tmp_path) -> None:
    done = _check("nodes_transport_check", "\n".join(["NCCL INFO Bootstrap", *lines, ""]), tmp_path)
    assert (done.returncode == 0) is ok, done.stdout
    assert ("through its network transport: PASS" in done.stdout) is ok, done.stdout


def test_the_stage_skips_with_its_reason_on_one_gpu(tmp_path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\n[ "$1" = -L ] && { echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; }\necho "NVIDIA H200"\n'
    )
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", "-c", f'use_impi() {{ :; }}; export -f use_impi; "{SCRIPT}" nodes'],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIP nodes" in done.stdout and "(needs 2 GPUs, this machine has 1)" in done.stdout, done.stdout
    assert "failed steps: 0" in done.stdout


def _hydra() -> str:
    launcher = mpiexec()
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30, check=False)
    if "HYDRA" not in version.stdout:
        pytest.skip(f"{launcher} is not MPICH's Hydra: named hosts with the fork launcher are MPICH's")
    return launcher


@pytest.mark.parametrize("visible", [None, "5,3,7"])
def test_node_rank_gives_each_node_a_host_id_and_each_rank_a_gpu(visible: str | None) -> None:
    env = outside_job_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    wrapper = str(ROOT / "scripts" / "node-rank.sh")
    command = [_hydra(), "-launcher", "fork", "-hosts", "nodeA:2,nodeB:1", "-n", "3", wrapper,
               "sh", "-c", 'echo "$PMI_RANK $NCCL_HOSTID $CUDA_VISIBLE_DEVICES"']  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = sorted(line.split() for line in done.stdout.splitlines())
    gpus = (visible or "0,1,2").split(",")
    assert seen == [["0", "mpigpu-nodeA", gpus[0]], ["1", "mpigpu-nodeA", gpus[1]], ["2", "mpigpu-nodeB", gpus[2]]]


def test_node_rank_refuses_to_run_outside_mpich_or_past_the_visible_gpus() -> None:
    wrapper = str(ROOT / "scripts" / "node-rank.sh")
    env = outside_job_env()
    done = subprocess.run([wrapper, "true"], capture_output=True, text=True, timeout=30, env=env, check=False)
    assert done.returncode == 2 and "PMI_RANK and PMI_HOSTNAME are unset" in done.stderr
    env.update(PMI_RANK="2", PMI_HOSTNAME="nodeB", CUDA_VISIBLE_DEVICES="0,1")
    done = subprocess.run([wrapper, "true"], capture_output=True, text=True, timeout=30, env=env, check=False)
    assert done.returncode == 2 and "rank 2, but CUDA_VISIBLE_DEVICES lists 2 GPU(s)" in done.stderr
