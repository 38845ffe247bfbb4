"""Run-time compilation of mpigpu's CUDA kernels: NVRTC through cuda.core, one cubin per source and
GPU architecture, cached on disk.

The cache key covers the source text, the options, the architecture and the NVRTC and cuda.core
versions. A file lock makes the first rank compile while the other ranks of the node wait and then
load its cubin, so one run compiles once and later runs compile never. The cache directory is
private (0700, ours, a real directory) and every entry carries the sha256 of its cubin: a file that
another user could have written is never loaded, and a corrupt one is recompiled and replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from mpigpu.core._cuda import as_core_stream, require_cuda_core
from mpigpu.core.build_cache import cached_build
from mpigpu.core.errors import KernelCompileError

__all__ = ["CompileStats", "Module", "compile_stats", "launch", "load_module"]

_STD_OPTIONS = {"std": "c++17"}


@dataclass
class CompileStats:
    """How one module was obtained: compiled now (and how long) or loaded from the cache."""

    source: str
    arch: str
    cached: bool
    milliseconds: float
    path: str


_stats: list[CompileStats] = []


def compile_stats() -> list[CompileStats]:
    """Every module obtained in this process, in order."""
    return list(_stats)


@dataclass
class Module:
    """A loaded cubin; ``kernel(name)`` returns a cached cuda.core Kernel."""

    object_code: Any
    stats: CompileStats
    _kernels: dict[str, Any] = field(default_factory=dict)

    def kernel(self, name: str) -> Any:
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = self.object_code.get_kernel(name)
        return kernel


def _source_text(name: str) -> str:
    """The source with ``#include "x.cuh"`` of mpigpu's own headers inlined (NVRTC needs no paths)."""
    root = resources.files("mpigpu.kernels")
    lines = []
    for line in root.joinpath(name).read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith('#include "') and stripped.endswith('.cuh"'):
            header = stripped.split('"')[1]
            lines.append(f"// ---- {header} ----")
            lines.extend(h for h in _source_text(header).splitlines() if h.strip() != "#pragma once")
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:
        return "unknown"


def _cache_dir() -> Path:
    from mpigpu.core.config import settings

    return settings().cache_dir


_modules: dict[tuple[str, str], Module] = {}
_lock = threading.Lock()


def load_module(source: str, arch: str) -> Module:
    """The module compiled from ``kernels/<source>`` for ``arch`` (e.g. "90"), once per process."""
    key = (source, arch)
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = _modules[key] = _load(source, arch)
    return module


def _load(source: str, arch: str) -> Module:
    core = require_cuda_core("run-time kernel compilation")
    text = _source_text(source)
    options = dict(_STD_OPTIONS, arch=f"sm_{arch}")
    digest = hashlib.sha256(
        "\0".join([text, repr(sorted(options.items())), _nvrtc_version(), core.__version__]).encode()
    ).hexdigest()[:20]
    root = _cache_dir()
    name = f"{Path(source).stem}-sm{arch}-{digest}{_SUFFIX}"
    start = time.perf_counter()
    cubin, cached = cached_build(root, _SUBDIR, name, MAGIC, lambda: _compile(core, text, source, options))
    object_code = core.ObjectCode.from_cubin(cubin, name=source)
    stats = CompileStats(source, f"sm_{arch}", cached, (time.perf_counter() - start) * 1e3, str(root / _SUBDIR / name))
    _stats.append(stats)
    return Module(object_code, stats)


# -- the on-disk cache ---------------------------------------------------------------------------------
# <cache>/kernels/<source>-sm<arch>-<digest of the inputs>.v1.cubin holds MAGIC, the sha256 of the cubin,
# then the cubin (mpigpu.core.build_cache: trusted and intact, or rebuilt).

_SUBDIR = "kernels"
_SUFFIX = ".v1.cubin"  # the entry format's version: entries of other formats are never read as this one
MAGIC = b"mpigpu-cubin-1\n"


def _compile(core: Any, text: str, source: str, options: dict[str, Any]) -> bytes:
    program = core.Program(text, code_type="c++", options=core.ProgramOptions(name=source, **options))
    try:
        code = program.compile("cubin")
    except Exception as exc:
        # cuda.core's NVRTCError carries the compilation log in its message
        raise KernelCompileError(f"NVRTC could not compile {source} for {options['arch']}", str(exc)) from exc
    finally:
        with contextlib.suppress(Exception):
            program.close()
    return bytes(code.code)


def launch(stream: Any, kernel: Any, count: int, *args: Any, block: int = 256, max_blocks: int = 65535) -> None:
    """Launch a grid-stride kernel over ``count`` items on ``stream``: a cuda.core Stream, or any stream
    resolve_stream takes (a StreamRef, a CuPy or PyTorch stream, a handle), wrapped by as_core_stream."""
    core = require_cuda_core()
    blocks = max(1, min(max_blocks, (count + block - 1) // block))
    config = core.LaunchConfig(grid=blocks, block=block)
    core.launch(as_core_stream(stream), config, kernel, *args)


def i64(value: int) -> np.int64:
    """A kernel's long long argument (typed: a Python int would be passed as a pointer)."""
    return np.int64(value)


def i32(value: int) -> np.int32:
    return np.int32(value)
