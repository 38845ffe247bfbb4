"""A GPU-only backend asked for where not every rank has a GPU: the error says what to do instead
(issue 12, section 4), and the README's error table shows that message."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT, gpu_available

import mpigpu
from mpigpu.core.errors import BackendUnavailable

FIX = "use backend='auto', 'cpu' or 'host' for NumPy arrays"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["nccl", "ipc", "cuda-aware"])
def test_a_gpu_only_backend_without_gpus_names_the_fix(comm, backend: str) -> None:
    if gpu_available():
        pytest.skip("this machine has a GPU: the message is for machines without one")
    x = np.arange(6, dtype=np.float64) + comm.Get_rank()
    with pytest.raises(BackendUnavailable) as info:
        mpigpu.allreduce(x, backend=backend)
    message = str(info.value)
    assert message.startswith(f"backend {backend!r} is not available here: ")
    assert FIX in message and "one rank per GPU" in message, message
    assert np.array_equal(x, np.arange(6, dtype=np.float64) + comm.Get_rank())
    # and the fix works: auto takes the same array
    expected = comm.allreduce(x.copy())  # exact: small integers in float64
    assert np.array_equal(mpigpu.allreduce(x, "sum"), expected)


def test_the_readme_error_table_shows_the_message_without_gpus() -> None:
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `BackendUnavailable")]
    assert any("not every rank has a GPU" in row and FIX in row for row in rows), rows
