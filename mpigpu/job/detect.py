"""What this MPI and machine can do: CUDA-awareness of the MPI library (and which rule decided),
NCCL. ``python -m mpigpu.info`` prints all of it.

Passing a device pointer to an MPI that is not CUDA-aware crashes the process, so the CUDA-aware
path runs only on positive evidence (or a user override that no evidence contradicts).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from mpigpu.core._mpi import LibraryInfo, libmpi_path

__all__ = ["CudaAwareness", "NcclInfo", "detect_cuda_awareness", "detect_nccl"]


@dataclass(frozen=True)
class CudaAwareness:
    """The verdict, the rule that decided it, and every finding on the way."""

    aware: bool
    rule: str
    findings: tuple[str, ...]
    refused_override: bool = False  # MPIGPU_CUDA_AWARE=1 contradicted by definite evidence

    def describe(self) -> str:
        return f"{'yes' if self.aware else 'no'} ({self.rule})"


def _query_symbol(path: str, symbol: str) -> int | None:
    """Call an int-returning, argument-less MPIX query in the loaded libmpi (None if absent)."""
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        func = getattr(lib, symbol)
    except (OSError, AttributeError):
        return None
    func.restype = ctypes.c_int
    func.argtypes = []
    try:
        return int(func())
    except Exception:
        return None


def _env_at_least_one(name: str) -> bool:
    try:
        return int(os.environ.get(name, "0")) >= 1
    except ValueError:
        return False


def detect_cuda_awareness(comm: Any, lib: LibraryInfo, override: bool | None) -> CudaAwareness:
    """Decide whether device pointers may be passed to this MPI (local to this rank)."""
    findings: list[str] = []
    positive: str | None = None
    negative: str | None = None

    kinds = None
    try:
        kinds = comm.Get_info().Get("mpi_memory_alloc_kinds")
    except Exception as exc:  # MPI < 4.1 or no info support
        findings.append(f"MPI_Info mpi_memory_alloc_kinds: unreadable ({type(exc).__name__})")
    if kinds is not None:
        findings.append(f"MPI_Info mpi_memory_alloc_kinds = {kinds}")
        if "cuda" in kinds.lower():
            positive = positive or f"MPI_Info mpi_memory_alloc_kinds = {kinds}"
        else:
            negative = negative or f"MPI_Info mpi_memory_alloc_kinds = {kinds} (no cuda)"
    elif not findings:
        findings.append("MPI_Info mpi_memory_alloc_kinds: not set")

    path = libmpi_path()
    query = _query_symbol(path, "MPIX_Query_cuda_support")
    if query is None:
        findings.append("MPIX_Query_cuda_support(): not in the loaded libmpi")
        if lib.name == "Open MPI":
            negative = negative or "Open MPI without its CUDA extension (no MPIX_Query_cuda_support)"
    else:
        findings.append(f"MPIX_Query_cuda_support() = {query}")
        if query:
            positive = positive or "MPIX_Query_cuda_support() = 1"
        elif lib.name in ("Open MPI", "MPICH"):
            negative = negative or "MPIX_Query_cuda_support() = 0"

    env_rules = (
        ("Intel MPI", "I_MPI_OFFLOAD"),
        ("MVAPICH", "MV2_USE_CUDA"),
        ("Cray MPICH", "MPICH_GPU_SUPPORT_ENABLED"),
    )
    for name, var in env_rules:
        if lib.name == name:
            value = os.environ.get(var)
            findings.append(f"{var} = {value if value is not None else 'unset'}")
            if _env_at_least_one(var):
                positive = positive or f"{name} with {var}={value}"
            else:
                negative = negative or f"{name} without {var}>=1"

    if override is False:
        return CudaAwareness(False, "MPIGPU_CUDA_AWARE=0 (user override)", tuple(findings))
    if positive:
        return CudaAwareness(True, positive, tuple(findings))
    if override is True:
        if negative:
            return CudaAwareness(
                False,
                f"MPIGPU_CUDA_AWARE=1 refused: {negative}",
                tuple(findings),
                refused_override=True,
            )
        return CudaAwareness(True, "MPIGPU_CUDA_AWARE=1 (user override; nothing contradicts it)", tuple(findings))
    if negative:
        return CudaAwareness(False, negative, tuple(findings))
    return CudaAwareness(
        False, "no evidence of CUDA support (set MPIGPU_CUDA_AWARE=1 if you know it is)", tuple(findings)
    )


@dataclass(frozen=True)
class NcclInfo:
    available: bool
    version: str
    reason: str


def detect_nccl(gpus: int) -> NcclInfo:
    """Whether CuPy's NCCL bindings load here."""
    if gpus == 0:
        return NcclInfo(False, "", "no GPU")
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return NcclInfo(False, "", f"cupy.cuda.nccl cannot be imported ({exc}); install the nvidia-nccl wheel")
    if not getattr(nccl, "available", True):
        return NcclInfo(False, "", "CuPy was built without NCCL; pip install nvidia-nccl-cu12/13")
    try:
        code = int(nccl.get_version())
    except Exception as exc:
        return NcclInfo(False, "", f"NCCL library not loadable ({exc})")
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)  # NCCL_VERSION_CODE
    minor, patch = divmod(rest, 100)
    return NcclInfo(True, f"{major}.{minor}.{patch}", "cupy.cuda.nccl")
