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
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from mpigpu.core._cuda import visible_device_count
from mpigpu.core._mpi import launcher_local_rank, world
from mpigpu.core.errors import DeviceError
from mpigpu.core.typed import allgather_ints, allgather_text
from mpigpu.job.topology import Layout

__all__ = ["GpuInfo", "map_device", "process_devices"]


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


def map_device(layout: Layout, allow_shared: bool, per_rank: int = 0) -> GpuInfo | None:
    """Pick this rank's GPU (collective over the physical node), and the GPUs the process drives
    (``process_devices``; ``per_rank``: MPIGPU_DEVICES_PER_RANK). None on machines without GPUs."""
    global _warned_shared
    visible = visible_device_count()
    counts = [c for (c,) in allgather_ints(layout.phys_comm, [visible])]
    if visible == 0:
        if any(counts):
            raise DeviceError(
                f"rank {layout.rank} on {layout.hostnames[layout.rank]} sees no GPU, but other ranks on this "
                f"node see {max(counts)}. Check CUDA_VISIBLE_DEVICES "
                f"({os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) and the launcher's GPU binding."
            )
        return None
    if not _process_gpu:
        devices = _first_devices(layout, visible, per_rank)
        _process_devices.extend(devices)
        _process_gpu.append(devices[0])
    info = _describe(_process_gpu[0], visible)
    bus_ids = allgather_text(layout.phys_comm, info.pci_bus_id)
    sharing = len(bus_ids) - len(set(bus_ids))
    if sharing:
        distinct = len(set(bus_ids))
        message = f"{layout.phys_size} ranks on {layout.hostnames[layout.rank]} share {distinct} GPU(s)"
        if not allow_shared:
            raise DeviceError(
                f"{message}: more ranks than GPUs. Start at most {distinct} ranks per node, or set "
                "MPIGPU_ALLOW_SHARED_GPU=1 to let ranks share GPUs (slower; NCCL and ipc will be unavailable)."
            )
        if layout.phys_rank == 0 and not _warned_shared:
            warnings.warn(f"mpigpu: {message} (MPIGPU_ALLOW_SHARED_GPU=1)", RuntimeWarning, stacklevel=3)
            _warned_shared = True
    return info
