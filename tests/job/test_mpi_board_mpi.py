"""The check board across nodes (mpigpu/job/mpi_board.py): the argument check, and a tiny allreduce's
data, in one MPI_Allgather.

Under mpiexec (-n 1 to 4, any layout), on a board made over a duplicate of the world: the same
verdict and message as the MPI_Allreduce path on every rank over many random checks, every rank's
rows read back in rank order, and one Allgather per check. As subprocess jobs across MPI nodes (MPICH's
fork launcher: 2x2, 2+1, 3+1, 1+1 and one node), a context that spans nodes takes this board (at 1+1) or
the two-level one (mpigpu/job/node_mpi_board.py, where a node holds two ranks); a tiny sum
gives the bits of float32 addition in rank order on every rank; a mismatch between nodes raises the
same MismatchError on every rank with nothing written, and the next call pairs; with MPIGPU_CHECK=0
there is no board and the sums are still exact."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import random_checks, run_mpi

from mpigpu.job.check_board import DATA_BYTES, board_for, pack
from mpigpu.job.mpi_board import MAX_RANKS, MpiBoard, open_mpi_board


@pytest.mark.mpi(min_size=1)
def test_random_checks_give_the_mpi_paths_verdict_and_message_on_every_rank(comm, board_handler: str) -> None:
    on_board, plain = comm.Dup(), comm.Dup()
    rng = np.random.default_rng(99)  # the same draws on every rank
    try:
        board = open_mpi_board(on_board)
        assert board is not None and board_for(on_board) is board and board_for(plain) is None
        assert (board.native is not None) == (board_handler == "compiled"), "the path under test"
        random_checks(on_board, plain, rng, 300)
        assert board.k == 300, "one post per check"
        assert board.reached() is None, "no rank runs ahead of an Allgather: nothing to report"
        board.close()
        assert board_for(on_board) is None
    finally:
        on_board.Free()
        plain.Free()


@pytest.mark.usefixtures("board_handler")
@pytest.mark.mpi(min_size=1)
def test_posted_rows_are_every_ranks_in_rank_order_on_both_parities(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    dup = comm.Dup()
    try:
        board = MpiBoard(dup)
        count = DATA_BYTES // 8  # the whole data area
        rows = board.rows(np.float64, (count,))
        packed = pack([0, count, 2, 1, 1, 0, 0, 0, 0])
        for step in range(4):  # both buffers, twice
            mine = np.arange(count, dtype=np.float64) * (rank + 1) + step
            posted = board.agree_with(packed, mine, rows)
            assert posted is not None
            for r in range(n):
                assert np.array_equal(posted[r], np.arange(count) * (r + 1) + step), (step, r)
            assert board.posted() == [[0, count, 2, 1, 1, 0, 0, 0, 0]] * n
        other = pack([0, count + (rank == n - 1), 2, 1, 1, 0, 0, 0, 0])
        assert (board.agree_with(other, mine, rows) is None) == (n > 1), "a difference fails on every rank"
    finally:
        dup.Free()


def test_the_board_stops_at_max_ranks() -> None:
    class Large:  # only its size is read before the decision
        def Get_size(self) -> int:
            return MAX_RANKS + 1

    assert open_mpi_board(Large()) is None, "past MAX_RANKS the check goes through MPI_Allreduce(MAX)"


_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import mpigpu
    from mpigpu.core.errors import MismatchError
    from mpigpu.job.mpi_board import MpiBoard
    from mpigpu.job.node_mpi_board import NodeMpiBoard
    from mpigpu.runtime.context import Context

    ctx = Context.get()
    rank, n, check = ctx.rank, ctx.size, sys.argv[1] == "1"
    board = ctx.check_board
    if check and ctx.layout.num_nodes > 1:  # two levels where a node holds two ranks, else flat
        assert isinstance(board, NodeMpiBoard if max(ctx.layout.node_sizes) > 1 else MpiBoard), board
    if not check:
        assert board is None, board
    # float32 values whose sum depends on the order of the additions: the rank-order sum is the contract
    values = np.float32([1e8, 3.0, -1e8, 0.5, 7.25, -2.0, 1e-3, 11.0])
    x = np.float32([values[(rank + j) % 8] * (j + 1) for j in range(6)])
    expected = np.float32([values[j % 8] * (j + 1) for j in range(6)])
    for r in range(1, n):
        expected = expected + np.float32([values[(r + j) % 8] * (j + 1) for j in range(6)])
    exact = float(np.sum(np.arange(1, n + 1)))
    out = []
    for _ in range(3):  # the first call, then its record's reuse
        y = x.copy()
        mpigpu.allreduce(y, "sum")
        out.append(y.tobytes().hex())
        z = np.full(4, float(rank + 1))
        mpigpu.allreduce(z, "sum")
        assert np.all(z == exact), z
    if check:  # one round: one post on the board per call, the data in it (the record's launch is fused)
        from mpigpu.calls.pipeline import Record
        before = board.k
        mpigpu.allreduce(x.copy(), "sum")
        assert board.k == before + 1, (before, board.k)
        records = [r for r in ctx.plan_cache.values() if isinstance(r, Record) and r.x.shape == (6,)]
        assert records and all(r.fused is not None for r in records), records
    caught = None
    if check:  # without the check, unequal counts are the user's error that MPI may not catch
        poison = np.full(3 + (rank == n - 1), -7.0)
        try:
            mpigpu.allreduce(poison, "sum")
        except MismatchError as exc:
            caught = str(exc)
        assert np.all(poison == -7.0), "nothing written on a mismatch"
    after = np.full(5, float(rank + 1))
    mpigpu.allreduce(after, "sum")  # the next call pairs
    assert np.all(after == exact), after
    mine = {"rank": rank, "sums": out, "expected": expected.tobytes().hex(), "caught": caught}
    everyone = ctx.comm.gather(mine, root=0)
    if rank == 0:
        print(json.dumps(everyone))
""")


@pytest.mark.parametrize(
    ("hosts", "n"),
    [("nodeA:2,nodeB:2", 4), ("nodeA:2,nodeB:1", 3), ("nodeA:3,nodeB:1", 4), ("nodeA:1,nodeB:1", 2), ("nodeA:3", 3)],
    ids=["2x2", "2+1", "3+1", "1+1", "1x3"],
)
@pytest.mark.parametrize("check", ["1", "0"], ids=["check", "no-check"])
def test_a_tiny_call_across_nodes_is_rank_order_bits_and_a_mismatch_raises_everywhere(
    tmp_path: Path, hosts: str, n: int, check: str
) -> None:
    script = tmp_path / "across.py"
    script.write_text(_SCRIPT)
    result = run_mpi(n, [str(script), check], hosts=hosts, env={"MPIGPU_CHECK": check}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(line["rank"] for line in lines) == list(range(n))
    sums = {s for line in lines for s in line["sums"]}
    assert len(sums) == 1, "the same bits on every rank, every call"
    if check == "1":
        assert sums == {lines[0]["expected"]}, "float32 additions in rank order"
    caught = {line["caught"] for line in lines}
    if check == "1":
        assert len(caught) == 1 and None not in caught, "the same MismatchError on every rank"
        assert next(iter(caught)).startswith("allreduce: ranks passed different arguments (count: 3 on")
    else:
        assert caught == {None}, "no check made: nothing raised"
