"""Rank -> GPU: node-local rank modulo the GPUs this process can see.

Counting visible GPUs (not the machine's) is what makes launchers that pin one GPU per rank work:
Intel MPI with I_MPI_OFFLOAD=1, Slurm's --gpus-per-task and site wrappers set CUDA_VISIBLE_DEVICES
so each rank sees one device, which is then its device 0.

The GPU belongs to the process, not to a communicator: the first communicator mpigpu maps fixes it, and
every later one (a Horovod process set, a Split of the world) uses the same GPU. Node-local rank means
the rank among the job's processes on the node: from the world-sized communicator that is mapped
first, else from the launcher (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, ...). Mapping by the
rank inside a smaller communicator put rank 1 of 2, alone in its process set, on GPU 0 (seen on
2 x H100: Horovod's process-set tests failed on rank 1 only).

A process may drive several GPUs (mpigpu.multi): the node's visible GPUs are divided among its ranks,
``MPIGPU_DEVICES_PER_RANK`` each (default: visible // ranks on the node, at least 1). Node-local rank r
then holds GPUs r*G .. r*G+G-1, and its first one is the GPU the one-GPU calls use. With one rank per
GPU, or more ranks than GPUs, G is 1 and the mapping is node-local rank modulo visible GPUs as before.

A mis-launched job fails at start-up on every rank together, with one message that names the nodes:
more ranks than GPUs on a node (unless MPIGPU_ALLOW_SHARED_GPU=1), some ranks or nodes with GPUs and others
without, a rank that cannot take its GPUs. Every rank sends what it found (one exchange over the
communicator) and every rank decides from the same rows (``launch_problem``), so no rank waits for one
that failed alone.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from mpigpu.core._cuda import visible_device_count
from mpigpu.core._mpi import launcher_local_rank, world
from mpigpu.core.errors import DeviceError
from mpigpu.core.typed import allgather_text, allreduce_int
from mpigpu.job.check import mark_raised_everywhere
from mpigpu.job.topology import Layout

__all__ = ["Found", "GpuInfo", "launch_problem", "map_device", "process_devices"]


@dataclass(frozen=True)
class GpuInfo:
    """The GPU a rank uses."""

    index: int  # CUDA ordinal in this process's numbering (what torch/CuPy call the device)
    name: str
    pci_bus_id: str
    uuid: str
    compute_capability: tuple[int, int]
    visible: int  # GPUs this process can see
    cuda_visible_devices: str | None

    def describe(self) -> str:
        return f"GPU {self.index} {self.name} [{self.pci_bus_id}]"


def _describe(index: int, visible: int) -> GpuInfo:
    from mpigpu.core._cuda import require_cuda_core

    device = require_cuda_core().Device(index)
    cc = device.compute_capability
    try:
        uuid = str(device.uuid)
    except Exception:
        uuid = ""
    return GpuInfo(
        index=index,
        name=device.name,
        pci_bus_id=str(device.pci_bus_id),
        uuid=uuid,
        compute_capability=(int(cc.major), int(cc.minor)),
        visible=visible,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


_warned_shared = False
_process_gpu: list[int] = []  # this process's GPU index, fixed by the first mapping
_process_devices: list[int] = []  # this process's GPUs (several: mpigpu.multi), fixed with it


def _node_local_rank(layout: Layout) -> int:
    """This process's rank among the job's processes on its node (see the module docstring)."""
    if layout.size == world().Get_size():
        return layout.phys_rank
    local = launcher_local_rank()
    return local if local >= 0 else layout.phys_rank


def process_devices() -> list[int]:
    """The CUDA ordinals of the GPUs this process drives (fixed by the first mapping; [] before it, and
    on machines without GPUs)."""
    return list(_process_devices)


def _first_devices(layout: Layout, visible: int, per_rank: int) -> list[int]:
    """This process's GPUs: ``per_rank`` of them (0: visible // ranks on the node, at least 1)."""
    ranks = layout.phys_size
    count = per_rank or max(1, visible // ranks)
    local = _node_local_rank(layout)
    if count == 1:
        return [local % visible]
    if count * ranks > visible:
        raise DeviceError(
            f"MPIGPU_DEVICES_PER_RANK={count} with {ranks} rank(s) on {layout.hostnames[layout.rank]} needs "
            f"{count * ranks} GPUs; this process sees {visible}. Start fewer ranks per node or lower it."
        )
    first = local * count
    return list(range(first, first + count))


class Found(NamedTuple):
    """What one rank found at start-up: its node (MPI's: numbered by its lowest rank, MPIGPU_NODE_SIZE aside),
    the GPUs it sees, its GPU's PCI bus id ("" without one), and why it could not take its GPUs ("" when it
    could)."""

    node: int
    host: str
    visible: int
    bus_id: str
    error: str


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def _node(rows: list[Found], node: int) -> str:
    """``node 1 (host gpu07: ranks 2,3)``."""
    ranks = [r for r, row in enumerate(rows) if row.node == node]
    return f"node {node} (host {rows[ranks[0]].host}: {_ranks(ranks)})"


def launch_problem(rows: list[Found], allow_shared: bool) -> tuple[str, str]:
    """(error, warning) for the job whose ranks found ``rows`` (rank order): the one error every rank raises
    ("" if none) and the note of GPUs shared by choice ("" if none). Pure: every rank decides alike."""
    failed = [f"rank {r} on {_node(rows, row.node)}: {row.error}" for r, row in enumerate(rows) if row.error]
    if failed:
        return "mpigpu start-up did not run: a rank could not take its GPUs.\n  " + "\n  ".join(failed), ""
    nodes = sorted({row.node for row in rows})
    with_gpus = [r for r, row in enumerate(rows) if row.visible]
    if with_gpus and len(with_gpus) < len(rows):
        without = [r for r, row in enumerate(rows) if not row.visible]
        seen = ", ".join(
            f"{_node(rows, n)} sees {max(rows[r].visible for r in with_gpus if rows[r].node == n)}"
            for n in nodes
            if any(rows[r].node == n for r in with_gpus)
        )
        blind = "; ".join(
            f"{_ranks([r for r in without if rows[r].node == n])} on {_node(rows, n)}"
            for n in nodes
            if any(rows[r].node == n for r in without)
        )
        return (
            f"some ranks see GPUs and others none: no GPU for {blind}, while {seen} GPU(s). Launch every rank "
            "where it sees a GPU (check CUDA_VISIBLE_DEVICES, the scheduler's GPU request such as Slurm's "
            "--gpus-per-node, and the launcher's GPU binding on each node), or hide the GPUs from every rank "
            "(CUDA_VISIBLE_DEVICES='') to run on the CPUs alone.",
            "",
        )
    shared = []
    for n in nodes:
        ids = [row.bus_id for row in rows if row.node == n and row.bus_id]
        if len(ids) > len(set(ids)):
            shared.append(f"{len(ids)} ranks share {len(set(ids))} GPU(s) on {_node(rows, n)}")
    if not shared:
        return "", ""
    if allow_shared:
        return "", f"{'; '.join(shared)} (MPIGPU_ALLOW_SHARED_GPU=1)"
    return (
        f"more ranks than GPUs: {'; '.join(shared)}. Start at most one rank per GPU on each node (Slurm: "
        "--ntasks-per-node equal to --gpus-per-node; Open MPI: --map-by ppr:<GPUs>:node; MPICH and Intel MPI: "
        "-ppn <GPUs>), or set MPIGPU_ALLOW_SHARED_GPU=1 to let ranks share GPUs (slower; NCCL and ipc will be "
        "unavailable).",
        "",
    )


def _found(layout: Layout, per_rank: int, node: int) -> tuple[Found, GpuInfo | None]:
    """This rank's row for ``launch_problem``, and its GPU (None without one, or when it failed)."""
    visible = visible_device_count()
    host = layout.hostnames[layout.rank]
    if visible == 0:
        return Found(node, host, 0, "", ""), None
    try:
        if not _process_gpu:
            devices = _first_devices(layout, visible, per_rank)
            _process_devices.extend(devices)
            _process_gpu.append(devices[0])
        info = _describe(_process_gpu[0], visible)
    except Exception as exc:  # every rank must hear of it, in the exchange below
        return Found(node, host, visible, "", f"{type(exc).__name__}: {exc}"), None
    return Found(node, host, visible, info.pci_bus_id, ""), info


def map_device(layout: Layout, allow_shared: bool, per_rank: int = 0) -> GpuInfo | None:
    """Pick this rank's GPU, and the GPUs the process drives (``process_devices``; ``per_rank``:
    MPIGPU_DEVICES_PER_RANK). Collective over ``layout.comm``: a mis-launch (``launch_problem``) raises the
    same DeviceError on every rank. None on machines without GPUs."""
    global _warned_shared
    # the physical node (GPUs are shared per machine, whatever MPIGPU_NODE_SIZE splits), by its lowest rank
    leader = allreduce_int(layout.phys_comm, layout.rank, "min")
    mine, info = _found(layout, per_rank, leader)
    texts = allgather_text(layout.comm, "\x1f".join(map(str, mine)))
    leaders = sorted({int(t.split("\x1f", 1)[0]) for t in texts})
    rows = [Found(leaders.index(int(n)), h, int(v), b, e) for n, h, v, b, e in (t.split("\x1f") for t in texts)]
    error, warning = launch_problem(rows, allow_shared)
    if error:
        raise mark_raised_everywhere(layout.comm, DeviceError(error), same_text=True)
    if warning and layout.rank == 0 and not _warned_shared:
        warnings.warn(f"mpigpu: {warning}", RuntimeWarning, stacklevel=3)
        _warned_shared = True
    return info
