"""The element types mpigpu reduces, and how each maps to NumPy, MPI, NCCL and CUDA C (one table)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from mpigpu.core._mpi import MPI
from mpigpu.core.errors import InvalidArgument

__all__ = ["DTYPES", "DType", "parse_dtype"]


@dataclass(frozen=True)
class DType:
    """One supported element type."""

    name: str
    np: np.dtype
    ctype: str  # CUDA C spelling, used by the kernels
    acc_name: str  # type the reduction accumulates in: float32 for the half types
    nccl: int | None  # ncclDataType_t, or None where NCCL has no such type
    code: int  # stable small integer, used in the cross-rank signature check
    mpi_name: str | None  # mpi4py's name of the MPI datatype; None for the half types (float32 or keys on the wire)

    @property
    def itemsize(self) -> int:
        return self.np.itemsize

    @property
    def is_float(self) -> bool:
        return self.np.kind == "f" or self.name == "bfloat16"

    @property
    def is_half(self) -> bool:
        """float16 and bfloat16 reduce in float32 and are rounded once."""
        return self.acc_name != self.name

    @property
    def acc(self) -> DType:
        return DTYPES[self.acc_name]

    @property
    def unsigned(self) -> DType:
        """The unsigned integer type of the same width: the type of float keys and bit patterns."""
        return DTYPES[f"uint{8 * self.itemsize}"]

    @property
    def mpi(self) -> Any:
        """The MPI datatype (initialises MPI). The half types have none: reduce them as float32 or as keys."""
        if self.mpi_name is None:
            raise InvalidArgument(f"{self.name} has no MPI datatype: it travels as float32 or as keys")
        return getattr(MPI(), self.mpi_name)

    @property
    def eps(self) -> float:
        """Machine epsilon (floats) or 0 (ints)."""
        if not self.is_float:
            return 0.0
        return float(ml_dtypes.finfo(self.np).eps)


def _d(name: str, np_dtype: Any, ctype: str, acc: str | None, nccl: int | None, code: int, mpi: str | None) -> DType:
    return DType(name, np.dtype(np_dtype), ctype, acc or name, nccl, code, mpi)


# ncclDataType_t values: int8 0, uint8 1, int32 2, uint32 3, int64 4, uint64 5, half 6, float 7,
# double 8, bfloat16 9. NCCL has no 16-bit integers.
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        _d("float16", np.float16, "__half", "float32", 6, 1, None),
        _d("bfloat16", ml_dtypes.bfloat16, "__nv_bfloat16", "float32", 9, 2, None),
        _d("float32", np.float32, "float", None, 7, 3, "FLOAT"),
        _d("float64", np.float64, "double", None, 8, 4, "DOUBLE"),
        _d("int8", np.int8, "signed char", None, 0, 5, "INT8_T"),
        _d("uint8", np.uint8, "unsigned char", None, 1, 6, "UINT8_T"),
        _d("int16", np.int16, "short", None, None, 7, "INT16_T"),
        _d("uint16", np.uint16, "unsigned short", None, None, 8, "UINT16_T"),
        _d("int32", np.int32, "int", None, 2, 9, "INT32_T"),
        _d("uint32", np.uint32, "unsigned int", None, 3, 10, "UINT32_T"),
        _d("int64", np.int64, "long long", None, 4, 11, "INT64_T"),
        _d("uint64", np.uint64, "unsigned long long", None, 5, 12, "UINT64_T"),
    )
}

_ALIASES = {
    "half": "float16", "fp16": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "float": "float32", "fp32": "float32", "f32": "float32", "single": "float32",
    "double": "float64", "fp64": "float64", "f64": "float64",
}  # fmt: skip

_BY_NUMPY = {d.np: d for d in DTYPES.values()}


_SEEN: dict[Any, DType] = {}  # dtype objects already parsed (hot path: one dict lookup)


def parse_dtype(value: Any) -> DType:
    """Map a name ("bf16", "float32"), a NumPy dtype, or a torch/CuPy dtype to a DType."""
    try:
        return _SEEN[value]
    except (KeyError, TypeError):
        pass
    found = _parse_dtype(value)
    with contextlib.suppress(TypeError):  # unhashable: fine, just not cached
        _SEEN[value] = found
    return found


def _parse_dtype(value: Any) -> DType:
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.").removeprefix("numpy.")
        key = _ALIASES.get(key, key)
        if key in DTYPES:
            return DTYPES[key]
        raise InvalidArgument(
            f"unsupported dtype {value!r}: use one of {', '.join(DTYPES)} (aliases: {', '.join(_ALIASES)})"
        )
    text = str(value)
    if text.startswith("torch."):  # torch.float32, torch.bfloat16, ...
        return parse_dtype(text.removeprefix("torch."))
    try:
        np_dtype = np.dtype(value)
    except TypeError:
        np_dtype = None
    if np_dtype is not None and np_dtype in _BY_NUMPY:
        return _BY_NUMPY[np_dtype]
    raise InvalidArgument(
        f"unsupported dtype {text}: mpigpu reduces {', '.join(DTYPES)}; "
        "bool, complex, object and string arrays cannot be averaged (cast them first)"
    )
