"""Run-time compilation of mpigpu's CUDA kernels: NVRTC through cuda.core, one cubin per source and
GPU architecture, cached on disk.

The cache key covers the source text, the options, the architecture and the NVRTC and cuda.core
versions. A file lock makes the first rank compile while the other ranks of the node wait and then
load its cubin, so one run compiles once and later runs compile never.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from mpigpu._cuda import require_cuda_core
from mpigpu.errors import KernelCompileError

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
    from mpigpu.config import settings

    return settings().cache_dir / "kernels"


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
    directory = _cache_dir()
    path = directory / f"{Path(source).stem}-sm{arch}-{digest}.cubin"
    start = time.perf_counter()
    cached = True
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f".{path.name}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists() and path.stat().st_size > 0:
                cubin = path.read_bytes()
            else:
                cached = False
                cubin = _compile(core, text, source, options)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_bytes(cubin)
                os.replace(tmp, path)
    except OSError:  # read-only home, full disk: compile in memory, every time
        cached = False
        cubin = _compile(core, text, source, options)
    object_code = core.ObjectCode.from_cubin(cubin, name=source)
    stats = CompileStats(source, f"sm_{arch}", cached, (time.perf_counter() - start) * 1e3, str(path))
    _stats.append(stats)
    return Module(object_code, stats)


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
    """Launch a grid-stride kernel over ``count`` items on ``stream`` (needs ``__cuda_stream__``)."""
    core = require_cuda_core()
    blocks = max(1, min(max_blocks, (count + block - 1) // block))
    config = core.LaunchConfig(grid=blocks, block=block)
    core.launch(stream, config, kernel, *args)


def i64(value: int) -> np.int64:
    """A kernel's long long argument (typed: a Python int would be passed as a pointer)."""
    return np.int64(value)


def i32(value: int) -> np.int32:
    return np.int32(value)
