"""How much memory this node and this rank's GPU have free: what a command checks before it
allocates a buffer that cannot fit, so the user reads what it needs and what there is instead of
a MemoryError (or the kernel's OOM killer)."""

from __future__ import annotations

import os

__all__ = ["gpu_free_bytes", "host_available_bytes"]


def host_available_bytes() -> int | None:
    """Memory the node can give without swapping (Linux MemAvailable), else its free pages; None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def gpu_free_bytes(index: int) -> int | None:
    """Free memory on GPU ``index`` (this process's numbering), as the driver reports it; None if unknown."""
    try:
        from mpigpu.core._cuda import cupy

        cp = cupy()
        with cp.cuda.Device(index):
            free, _ = cp.cuda.runtime.memGetInfo()
        return int(free)
    except Exception:  # no CuPy or no driver: the allocation itself will say
        return None
