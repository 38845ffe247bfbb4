"""Starting mpigpu on a communicator exchanges fixed-format data only (mpiexec -n 1 to 4): no object
is pickled or unpickled by the context's start-up (settings, layout, devices, capabilities, the
check board, the tuning table), so the README's "only the *_object calls use pickle" holds there."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from conftest import fresh_context

import mpigpu


@contextmanager
def _pickled() -> Iterator[list[str]]:
    """The types of the objects mpi4py pickles while the block runs (on this rank)."""
    from mpi4py import MPI

    seen: list[str] = []

    def dumps(obj: Any, protocol: int | None = None) -> bytes:
        seen.append(type(obj).__name__)
        return pickle.dumps(obj, protocol)

    def loads(data: Any) -> Any:
        seen.append("loads")
        return pickle.loads(data)

    MPI.pickle.__init__(dumps, loads)
    try:
        yield seen
    finally:
        MPI.pickle.__init__(pickle.dumps, pickle.loads)


@pytest.mark.mpi(min_size=1)
def test_context_start_up_pickles_nothing(comm) -> None:
    x = np.arange(4, dtype=np.float64) + comm.Get_rank()
    with _pickled() as seen, fresh_context(comm):  # a new communicator: mpigpu starts on it
        mpigpu.allreduce(x, "sum", backend="cpu")
    assert seen == [], f"pickled at start-up: {seen}"
    n = comm.Get_size()
    assert np.array_equal(x, np.arange(4) * n + n * (n - 1) / 2)
