"""The two-level check board across nodes (mpigpu/job/node_mpi_board.py): posts on node-shared memory,
one MPI_Allgather(v) among the node leaders, the result published back on the node.

Under mpiexec (-n 1 to 4), one machine split into "nodes" by comm.Split (they share memory, as a node's
ranks do): by blocks, round-robin, uneven (one rank alone first or last), on a duplicate of the world and
on a sub-communicator. On each: the same verdict and message as the MPI_Allreduce path on every rank over
many random checks, every rank's rows in rank order on both parities, a check's rows intact through the
next check (and overwritten only by the one after), a mismatch failing on every rank and the next check
pairing. One rank per node: no two-level board (the flat Allgather is the leaders' exchange).

As subprocess jobs across MPI nodes (MPICH's fork launcher: 2x2, round-robin 2x2, 2+1, 1+2, 3+1, 4x1), the
context takes this board where a node holds two ranks; tiny float32 sums give the bits of addition in
rank order on every rank, a mismatch raises the same MismatchError on every rank with nothing written and
the next call pairs, on the world, a duplicate and halves made by comm.Split; /dev/shm is left as found."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import in_use, mpich_segments, random_checks, run_mpi

from mpigpu.core._mpi import MPI
from mpigpu.job.check_board import DATA_BYTES, board_for, pack
from mpigpu.job.node_mpi_board import NodeMpiBoard, open_node_mpi_board
from mpigpu.job.topology import node_ranks

# node of each rank (by rank, for n ranks) in the layouts simulated inside each machine (MPI node)
_LAYOUTS = {
    "blocks": lambda r, n: r * 2 // n,
    "round-robin": lambda r, n: r % 2,
    "one-first": lambda r, n: int(r > 0),
    "one-last": lambda r, n: int(r == n - 1),
    "one-node": lambda r, n: 0,
}


def _split(comm: Any, layout: str) -> tuple[Any, bool]:
    """The simulated node of this rank (ranks that share memory and the layout's node), and whether some
    node holds two ranks or more (collective)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    shared = comm.Split_type(MPI().COMM_TYPE_SHARED, key=rank)
    first = shared.allreduce(rank, op=MPI().MIN)  # the machine, named by its lowest rank
    shared.Free()
    node = comm.Split(_LAYOUTS[layout](rank, n) * n + first, rank)
    return node, comm.allreduce(node.Get_size(), op=MPI().MAX) >= 2


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_random_checks_give_the_mpi_paths_verdict_and_message(comm, layout: str, board_handler: str) -> None:
    on_board, plain = comm.Dup(), comm.Dup()
    node, pairs = _split(on_board, layout)
    rng = np.random.default_rng(7)  # the same draws on every rank
    try:
        board = open_node_mpi_board(on_board, node, node_ranks(on_board, node))
        if not pairs:
            assert board is None, "one rank per node: the flat Allgather"
            return
        assert isinstance(board, NodeMpiBoard) and board_for(on_board) is board and board_for(plain) is None
        assert (board.native is not None) == (board_handler == "compiled"), "the path under test"
        if board.native is not None:  # waits across nodes yield from the start, as the Python path's
            assert [p.spin_ns for p in board.native.plans] == [0, 0]
        random_checks(on_board, plain, rng, 200)
        assert board.k == 200, "one post per check"
        assert board.reached() is None
        board.close()
        assert board_for(on_board) is None
        board.close()  # idempotent
    finally:
        node.Free()
        on_board.Free()
        plain.Free()


@pytest.mark.usefixtures("board_handler")
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["blocks", "round-robin", "one-first", "one-last", "one-node"])
def test_rows_are_every_ranks_in_rank_order_and_last_until_the_check_after_next(comm, layout: str) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    dup = comm.Dup()
    sub = dup.Split(0 if n < 4 or rank < 3 else MPI().UNDEFINED, rank)  # at 4 ranks a sub-communicator of 3
    node = None
    try:
        if sub == MPI().COMM_NULL:
            dup.Barrier()
            return
        m = sub.Get_size()
        node, pairs = _split(sub, layout)
        board = open_node_mpi_board(sub, node, node_ranks(sub, node))
        if board is None:
            assert not pairs, "one rank per node: no two-level board"
            dup.Barrier()
            return
        count = DATA_BYTES // 8  # the whole data area
        rows = board.rows(np.float64, (count,))
        packed = pack([0, count, 2, 1, 1, 0, 0, 0, 0])
        previous = None
        for step in range(6):  # both parities, three times
            mine = np.arange(count, dtype=np.float64) * (rank + 1) + step
            posted = board.agree_with(packed, mine, rows)
            assert posted is not None and posted is rows[(step + 1) & 1]
            if previous is not None:  # the last check's rows still hold its values
                for r in range(m):
                    assert np.array_equal(previous[r], np.arange(count) * (r + 1) + step - 1), (step, r)
            for r in range(m):
                assert np.array_equal(posted[r], np.arange(count) * (r + 1) + step), (step, r)
            assert board.posted() == [[0, count, 2, 1, 1, 0, 0, 0, 0]] * m
            previous = posted
        other = pack([0, count + (rank == m - 1), 2, 1, 1, 0, 0, 0, 0])
        assert board.agree_with(other, mine, rows) is None, "a difference fails on every rank"
        assert board.posted()[m - 1][1] == count + 1, "every rank's values are read back"
        again = board.agree_with(packed, mine + 1, rows)  # the next check pairs
        assert again is not None and all(np.array_equal(again[r], np.arange(count) * (r + 1) + 6) for r in range(m))
        board.close()
        dup.Barrier()
    finally:
        for made in (node, sub):
            if made is not None and made != MPI().COMM_NULL:
                made.Free()
        dup.Free()


_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import mpigpu
    from mpigpu.core.errors import MismatchError
    from mpigpu.job.mpi_board import MpiBoard
    from mpigpu.job.node_mpi_board import NodeMpiBoard
    from mpigpu.runtime.context import Context

    def run(comm, tag):
        ctx = Context.get(comm)
        rank, n = ctx.rank, ctx.size
        board = ctx.check_board
        kind = type(board).__name__
        # float32 values whose sum depends on the order of the additions: the rank-order sum is the contract
        values = np.float32([1e8, 3.0, -1e8, 0.5, 7.25, -2.0, 1e-3, 11.0])
        x = np.float32([values[(rank + j) % 8] * (j + 1) for j in range(6)])
        expected = np.float32([values[j % 8] * (j + 1) for j in range(6)])
        for r in range(1, n):
            expected = expected + np.float32([values[(r + j) % 8] * (j + 1) for j in range(6)])
        sums = set()
        for i in range(20):  # the first call, then its record's reuse: both parities many times
            y = x.copy()
            mpigpu.allreduce(y, "sum", comm=comm)
            sums.add(y.tobytes().hex())
            z = np.full(4, float(rank + 1 + i), np.float64)
            mpigpu.allreduce(z, "sum", comm=comm)
            assert np.all(z == n * (n + 1) / 2 + n * i), (tag, z)
        poison = np.full(3 + (rank == n - 1), -7.0)
        caught = None if n > 1 else "one rank: nothing to compare"
        try:
            mpigpu.allreduce(poison, "sum", comm=comm)
        except MismatchError as exc:
            caught = str(exc)
        assert np.all(poison == -7.0), "nothing written on a mismatch"
        after = np.full(5, float(rank + 1))
        mpigpu.allreduce(after, "sum", comm=comm)  # the next call pairs
        assert np.all(after == n * (n + 1) / 2), after
        return {"tag": tag, "n": n, "kind": kind, "sums": sorted(sums), "expected": expected.tobytes().hex(),
                "caught": caught, "nodes": list(ctx.layout.node_sizes)}

    from mpigpu.core._mpi import world as the_world

    world = the_world()
    out = [run(world, "world")]
    dup = world.Dup()
    out.append(run(dup, "dup"))
    color = int(world.Get_rank() >= world.Get_size() // 2)
    half = world.Split(color, world.Get_rank())
    out.append(run(half, f"half{color}"))
    mpigpu.finalize()
    half.Free()
    dup.Free()
    everyone = world.gather(out, root=0)
    if world.Get_rank() == 0:
        print(json.dumps(everyone))
""")


@pytest.mark.parametrize(
    ("hosts", "n", "kind"),
    [
        ("nodeA:2,nodeB:2", 4, "NodeMpiBoard"),
        ("nodeA:1,nodeB:1", 4, "NodeMpiBoard"),  # round-robin: ranks 0,2 on node A
        ("nodeA:2,nodeB:1", 3, "NodeMpiBoard"),
        ("nodeA:1,nodeB:2", 3, "NodeMpiBoard"),
        ("nodeA:3,nodeB:1", 4, "NodeMpiBoard"),
        ("nodeA:1,nodeB:1,nodeC:1,nodeD:1", 4, "MpiBoard"),
    ],
    ids=["2x2", "2x2-round-robin", "2+1", "1+2", "3+1", "4x1"],
)
def test_tiny_sums_and_mismatches_across_nodes(tmp_path: Path, hosts: str, n: int, kind: str) -> None:
    script = tmp_path / "two_level.py"
    script.write_text(_SCRIPT)
    before = set(mpich_segments())
    result = run_mpi(n, [str(script)], hosts=hosts, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    new = set(mpich_segments()) - before
    assert not new - in_use(new), "no segment left in /dev/shm (another job's, mapped by its ranks, may be there)"
    ranks = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(ranks) == n
    for tag in ("world", "dup", "half0", "half1"):
        lines = [line for rank in ranks for line in rank if line["tag"] == tag]
        if not tag.startswith("half"):
            assert {line["kind"] for line in lines} == {kind}, (tag, lines)
        sums = {s for line in lines for s in line["sums"]}
        assert len(sums) == 1, f"{tag}: the same bits on every rank, every call"
        expected = {line["expected"] for line in lines}
        assert sums <= expected, f"{tag}: float32 additions in rank order"
        caught = {line["caught"] for line in lines}
        assert len(caught) == 1 and None not in caught, f"{tag}: the same MismatchError on every rank"
        if lines[0]["n"] > 1:
            assert next(iter(caught)).startswith("allreduce: ranks passed different arguments (count: 3 on"), caught


_KILL = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import mpigpu
    from mpigpu.runtime.context import Context

    ctx = Context.get()
    x = np.ones(2, np.float32)
    for _ in range(3):
        mpigpu.allreduce(x, "sum")
    if ctx.rank == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    mpigpu.allreduce(x, "sum")  # the others wait on the board for the killed rank
    print("done:", ctx.rank, flush=True)
""")


@pytest.mark.parametrize("victim", [2, 3], ids=["leader", "not-leader"])
def test_a_killed_rank_ends_the_job(tmp_path: Path, victim: int) -> None:
    """At 2x2, rank 2 (node B's leader: the others wait in the leaders' exchange and for its
    publication) or rank 3 (its leader waits in shared memory for its post) killed: the job ends with a
    failure status, long before run_mpi's hang limit, no rank finishing the call."""
    script = tmp_path / "kill.py"
    script.write_text(_KILL)
    result = run_mpi(4, [str(script), str(victim)], hosts="nodeA:2,nodeB:2", env={"MPIGPU_TIMEOUT": "30"}, timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "done:" not in result.stdout, "no rank passed the call the killed rank never made"
