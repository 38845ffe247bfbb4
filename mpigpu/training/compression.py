"""Gradient compression for the Averager: the half type the buckets travel in (float16 or bfloat16),
with the averages accumulated in float32 on the way (the backends' half-type rule)."""

from __future__ import annotations

from typing import Any

from mpigpu.core.dtypes import DType, parse_dtype
from mpigpu.core.errors import InvalidArgument

__all__ = ["COMPRESSIONS", "parse_compression"]

COMPRESSIONS = ("float16", "bfloat16")


def parse_compression(value: Any) -> DType | None:
    """The wire type ``compression=`` names (None: no compression), or InvalidArgument saying what is accepted."""
    if value is None:
        return None
    try:
        dtype = parse_dtype(value)
    except InvalidArgument:
        dtype = None
    if dtype is None or dtype.name not in COMPRESSIONS:
        raise InvalidArgument(f"compression must be None, 'float16' or 'bfloat16', not {value!r}")
    return dtype
