"""Rank -> GPU: node-local rank modulo the GPUs this process can see.

Counting visible GPUs (not the machine's) is what makes launchers that pin one GPU per rank work:
Intel MPI with I_MPI_OFFLOAD=1, Slurm's --gpus-per-task and site wrappers set CUDA_VISIBLE_DEVICES
so each rank sees one device, which is then its device 0.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from mpigpu.core._cuda import visible_device_count
from mpigpu.core.errors import DeviceError
from mpigpu.core.typed import allgather_ints, allgather_text
from mpigpu.job.topology import Layout

__all__ = ["GpuInfo", "map_device"]


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


def map_device(layout: Layout, allow_shared: bool) -> GpuInfo | None:
    """Pick this rank's GPU (collective over the physical node). None on machines without GPUs."""
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
    info = _describe(layout.phys_rank % visible, visible)
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
