"""``python -m mpigpu.info`` says how the argument check travels and on which path the board runs: the
node board on one machine (two-level or flat across MPI nodes), on the compiled exchange or on the
Python path with the reason, per rank."""

from __future__ import annotations

import pytest
from conftest import mpi_nodes

from mpigpu.info import gather_info, render


@pytest.mark.mpi(min_size=1)
def test_info_names_the_board_and_its_path(comm, board_handler: str) -> None:
    info = gather_info()
    check, n = info["check"], comm.Get_size()
    if n == 1:
        assert check == {"board": "none (one rank)", "python_ranks": None}
        return
    nodes = mpi_nodes(comm)
    if len(nodes) == 1:
        assert check["board"].startswith("node board"), check
    else:  # across MPI nodes: two levels where a node holds two ranks, else the flat Allgather
        want = "two-level board" if max(len(node) for node in nodes) > 1 else "flat board"
        assert check["board"].startswith(want), check
    if board_handler == "compiled":
        assert check["python_ranks"] == []
        assert "compiled exchange on every rank" in render(info)
    else:
        assert check["python_ranks"] == [(r, "MPIGPU_BOARD_HANDLER=python") for r in range(n)]
        assert "Python path on rank(s) 0: MPIGPU_BOARD_HANDLER=python" in render(info)
