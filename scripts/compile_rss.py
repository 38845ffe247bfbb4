"""What a first kernel compile costs in resident memory (issue 46: the soak's +193 MiB on a fresh machine).

    CUPY_CACHE_DIR=$(mktemp -d) python scripts/compile_rss.py

One process, one GPU. For each size of an out-of-place check (the soak's old check of changed input:
CuPy's ``count_nonzero((x != snap).any(axis=1))``, whose CUB reductions CuPy compiles with NVRTC per
block size), then for mpigpu's ``count_changed`` kernel (one module, compiled or loaded once), prints
the RSS after the call, its growth since the line before, and whether CuPy's kernel cache gained
files (a compile). Then ``malloc_trim(0)``: growth that it gives back is heap that NVRTC freed and
glibc kept; what stays is memory mapped or held. Run it with a fresh CUPY_CACHE_DIR to see compiles.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def cache_files() -> int:
    root = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    return sum(1 for _ in root.rglob("*")) if root.exists() else 0


def main() -> None:
    import cupy as cp

    from mpigpu.bench.workload import count_changed_device

    cc = cp.cuda.Device(0).compute_capability  # e.g. "90"
    gpu = SimpleNamespace(compute_capability=(int(cc[:-1]), int(cc[-1])))  # what the kernel loader reads
    cp.zeros(1).sum()  # CUDA context, CuPy's first kernels: not what is measured
    last, files = rss_mib(), cache_files()
    print(f"start: RSS {last:.0f} MiB, CuPy cache files {files}")
    for label, check in (
        ("CuPy any/count_nonzero", lambda x, s, n, w: int(cp.count_nonzero((x != s).reshape(n, w).any(axis=1)))),
        ("mpigpu count_changed", lambda x, s, n, w: count_changed_device(x.data.ptr, s.data.ptr, n, w, gpu, 0)),
    ):
        for width in (1, 8):
            for count in (3, 100, 700, 1500, 3000, 100_000):
                x = cp.arange(count * width, dtype=cp.uint8)
                check(x, x.copy(), count, width)
                now, new_files = rss_mib(), cache_files()
                print(
                    f"{label:24} {count:>7} x {width} B: RSS {now:6.0f} MiB ({now - last:+6.1f}), "
                    f"{'compiled' if new_files > files else 'no compile'}"
                )
                last, files = now, new_files
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    now = rss_mib()
    print(f"after malloc_trim(0): RSS {now:.0f} MiB ({now - last:+.1f})")
    print(f"numpy {np.__version__}, cupy {cp.__version__}")


if __name__ == "__main__":
    main()
