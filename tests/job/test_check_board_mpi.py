"""The node-local check board (mpigpu/job/check_board.py), under mpiexec (-n 1 to 4): the cross-rank
check through node-shared memory gives the same verdict and the same message on every rank as the
MPI path, over long runs of agreeing and disagreeing calls (both parities many times), when a rank
rejects its own arguments, and when ranks arrive far apart; the MPI path still works where no
board is used (a communicator of the user's own); and a simulated multi-node layout checks through
the Allgather board (mpigpu/job/mpi_board.py), as real nodes do."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import fresh_context, random_checks, run_mpi

import mpigpu
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.job.check import Signature, check_signature
from mpigpu.job.check_board import CheckBoard, board_for, open_board
from mpigpu.job.mpi_board import MpiBoard
from mpigpu.job.shm import SPIN_S


@pytest.mark.usefixtures("board_handler")
@pytest.mark.mpi(min_size=1)
def test_a_single_node_context_checks_through_its_board(comm) -> None:
    with fresh_context(comm) as ctx:
        board = ctx.check_board
        assert board is not None, "every rank is on this machine: the check goes through shared memory"
        assert board_for(ctx.comm) is board
        assert board_for(comm) is None, "only mpigpu's duplicate has the board, never the user's communicator"
        before = board.k
        for _ in range(2):  # the first call and its repeat (a call record's packed signature)
            mpigpu.allreduce(np.ones(3), comm=ctx.comm)
        n = comm.Get_size()
        assert board.k == before + (2 if n > 1 else 0), "each call's check went through the board (none at one rank)"


@pytest.mark.mpi(min_size=1)
def test_a_thousand_random_checks_agree_with_the_mpi_path_on_every_rank(comm, board_handler: str) -> None:
    plain = comm.Dup()  # no board: check_signature takes the MPI_Allreduce path on it
    rng = np.random.default_rng(1234)  # the same draws on every rank
    try:
        with fresh_context(comm) as ctx:
            board = ctx.check_board
            assert board is not None and board_for(plain) is None
            assert (board.native is not None) == (board_handler == "compiled"), "the path under test"
            if isinstance(board, MpiBoard) and board.native is not None:  # one rank per node: the flat board
                assert [p.nwaits for p in board.native.plans] == [0, 0], "MPI_Allgather is all it waits in"
            elif board.native is not None:  # the node board's waits spin first, the two-level one's yield at once
                spin = round(SPIN_S * 1e9) if isinstance(board, CheckBoard) else 0
                assert [p.spin_ns for p in board.native.plans] == [spin] * 2
            random_checks(ctx.comm, plain, rng, 1000)
            assert board.k >= 1000, "both parities, hundreds of times over"
    finally:
        plain.Free()


@pytest.mark.usefixtures("board_handler")
@pytest.mark.mpi(min_size=1)
def test_parity_wrap_around_with_mismatches_on_either_parity(comm) -> None:
    rank = comm.Get_rank()
    with fresh_context(comm) as ctx:
        board = ctx.check_board
        assert board is not None
        for step in range(8):  # a mismatch at k odd and at k even, agreeing checks between them
            parity = (board.k + 1) & 1
            bad = Signature(10 + (rank == comm.Get_size() - 1), 1, 1, 1, 0, shape=(10 + (rank == comm.Get_size() - 1),))
            good = Signature(10, 1, 1, 1, 0, shape=(10,))
            if comm.Get_size() > 1 and step % 2 == 0:
                with pytest.raises(MismatchError, match="count: 10 on rank"):
                    check_signature(ctx.comm, bad)
            else:
                check_signature(ctx.comm, good)
            assert (board.k & 1) == parity


@pytest.mark.usefixtures("board_handler")
@pytest.mark.mpi(min_size=2)
def test_ranks_that_arrive_far_apart_still_agree(comm) -> None:
    rank = comm.Get_rank()
    with fresh_context(comm) as ctx:
        assert ctx.check_board is not None
        x = np.full(6, float(rank + 1))
        for late in range(comm.Get_size()):
            if rank == late:
                time.sleep(0.05)  # past the spin and the yields: the others sleep-wait
            mpigpu.allreduce(x, "max", comm=ctx.comm)
            assert np.all(x == comm.Get_size())


@pytest.mark.usefixtures("board_handler")
@pytest.mark.mpi(min_size=2)
def test_a_rank_that_rejects_its_arguments_is_named_on_every_other_rank(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    with fresh_context(comm) as ctx:
        before = ctx.check_board.k
        x = np.full(4, float(rank))
        if rank == 1:
            x.flags.writeable = False
            with pytest.raises(InvalidArgument, match="read-only"):
                mpigpu.allreduce(x, "sum", comm=ctx.comm)
        else:
            with pytest.raises(MismatchError, match="rank 1: InvalidArgument: x is read-only"):
                mpigpu.allreduce(x, "sum", comm=ctx.comm)
        assert ctx.check_board.k == before + 1
        y = np.full(4, float(rank))  # the communicator still works, on every rank
        mpigpu.allreduce(y, "sum", comm=ctx.comm)
        assert np.all(y == n * (n - 1) / 2)


@pytest.mark.mpi(min_size=1)
def test_no_board_without_a_shared_communicator_and_the_mpi_path_still_checks(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    dup = comm.Dup()
    try:
        assert open_board(dup, None) is None  # spans nodes: every rank says so, none makes a segment
        assert board_for(dup) is None
        check_signature(dup, Signature(7, 1, 1, 1, 0, shape=(7,)))
        if n > 1:
            with pytest.raises(MismatchError, match=f"count: 7 on {'rank 0' if n == 2 else 'ranks'}"):
                check_signature(dup, Signature(7 + (rank == n - 1), 1, 1, 1, 0, shape=(7 + (rank == n - 1),)))
    finally:
        dup.Free()


def test_simulated_multi_node_layout_checks_through_the_allgather_board(tmp_path: Path) -> None:
    script = tmp_path / "multinode.py"
    script.write_text(
        textwrap.dedent("""
        import json, numpy as np, mpigpu
        from mpigpu.runtime.context import Context
        from mpigpu.core.errors import MismatchError
        from mpigpu.job.mpi_board import MpiBoard
        ctx = Context.get()
        assert ctx.layout.num_nodes == 2 and isinstance(ctx.check_board, MpiBoard), ctx.check_board
        x = np.full(3, float(ctx.rank + 1))
        for _ in range(3):  # the first call, then its record's packed signature, by one MPI_Allgather
            x[:] = ctx.rank + 1
            mpigpu.allreduce(x, "sum")
            assert np.all(x == 3), x
        caught = None
        try:
            mpigpu.allreduce(np.ones(3 + ctx.rank))
        except MismatchError as exc:
            caught = str(exc)
        x = np.ones(2)
        mpigpu.allreduce(x, "sum")
        assert np.all(x == 2), x
        try:  # after reused calls: another op on one rank
            mpigpu.allreduce(x, "sum" if ctx.rank == 0 else "max")
            raise AssertionError("no MismatchError")
        except MismatchError as exc:
            assert "op: sum on rank 0; max on rank 1" in str(exc), exc
        everyone = ctx.comm.gather(caught, root=0)
        if ctx.rank == 0:
            print(json.dumps(everyone))
        """)
    )
    result = run_mpi(2, [str(script)], env={"MPIGPU_NODE_SIZE": "1"})
    assert result.returncode == 0, result.stderr
    caught = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(caught) == 2 and caught[0] == caught[1], "the same message on both ranks"
    assert caught[0].startswith("allreduce: ranks passed different arguments (count: 3 on rank 0; 4 on rank 1")
