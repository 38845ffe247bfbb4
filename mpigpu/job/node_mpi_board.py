"""The check board across nodes in two levels: node-shared memory inside each node, one MPI_Allgather(v)
among the node leaders between them.

The flat board (mpigpu.job.mpi_board) moves every rank's 256-byte slot with an MPI_Allgather over all
N ranks: every slot crosses the nodes, in log2 N rounds of messages. Here only the node leaders (the
lowest rank of ``comm`` on each node) call MPI, over a communicator of the leaders made once when the
board opens, and a check is:

1. every rank posts its slot ``[k, 9 values, data]`` (the flat board's layout) on a node-shared segment
   (mpigpu.job.shm.SharedSegment), as on the node board: values and data, a fence where the CPU needs
   one, then ``k``;
2. the leader waits for its node's slots of this parity (``shm.wait_at_least``; below), then
   one MPI_Allgather (nodes of equal size) or MPI_Allgatherv among the leaders moves each node's block
   of slots, straight from the segment, into the segment's result area: every rank's slot, node by
   node;
3. the leader fences and publishes ``k``; the other ranks of the node wait for it, and every rank then
   compares every rank's values with its own and reads every rank's data, as on the flat board: the
   same verdict and, for a tiny allreduce (mpigpu.backends.cpu_board), the same bits on every rank.

Rows are found by rank (``rows``, ``posted``): where each node's ranks are consecutive in ``comm`` the
result area is in rank order; with round-robin placement a rank's slot is where its node's block put it.

Two parities of both areas keep a check's rows valid until this rank's next check but one: a rank posts
check ``k + 2`` only after it has read check ``k + 1``'s result, which its leader published after the
exchange of ``k + 1``, so after the exchange of ``k`` had read every post of parity ``k % 2``; and the
leader overwrites result ``k % 2`` only once every rank of its node has posted ``k + 2``.

Every wait here (the leader's for its node, the others' for the leader) yields the CPU from its start
instead of spinning 20 us first as the node board does: the others wait through a whole exchange
between nodes, and on an oversubscribed machine (2x2 on 2 cores) a spinning rank holds the core its
leader needs (72 us a check against the flat board's 41 with the spin; 26-38 against 26-43 without).
With a core per rank ``sched_yield`` returns at once: the wait is a poll with a system call per read.

Used across nodes where a node holds two ranks or more (mpi_board.open_mpi_board decides, the same on every
rank); with one rank per node the flat Allgather is already the leaders' exchange. A rank that never
posts leaves its leader, and so every rank, waiting as in an MPI collective: the watchdog
(``MPIGPU_TIMEOUT``) ends the job with its usual error. ``reached`` is None (no rank runs ahead of the
leaders' exchange); the stall report then reads mpigpu.job.peers.NodeProgress. Each board (one per
communicator, a duplicate or a split included) has its own segment, an MPI shared window freed by
``close`` (collective, with the leaders' communicator) or by MPI_Finalize: it leaves no file of its own in
/dev/shm (while a job runs, only MPICH's per-node file is there).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from mpigpu.core._mpi import MPI
from mpigpu.job.check_board import FIELDS, SLOT_BYTES, WEAK_ORDER, BoardPosts, board_for, made_on_every_rank, register
from mpigpu.job.native_board import Exchange, Native, Plan, compiled, plan
from mpigpu.job.shm import SharedSegment, wait_at_least

__all__ = ["NodeMpiBoard", "open_node_mpi_board"]

_VALUES = 8 * FIELDS
_DATA = 8 + _VALUES  # a slot's data: its offset in bytes


class _Rows(tuple):  # type: ignore[type-arg]
    """``rows``' answer: per parity, every rank's row (a tuple, as the other boards give), and beside it
    ``posts``: per parity, this rank's own posted data, where ``agree_with`` writes."""

    posts: tuple[np.ndarray, np.ndarray]


class NodeMpiBoard(BoardPosts):
    """Signatures (and tiny data) of every rank of ``comm``: node-shared slots, one exchange among the
    node leaders per check.

    Collective to create (``open_node_mpi_board``) and to close. Used by one thread at a time, in the
    same order on every rank (the callers' rule), as the other boards."""

    def __init__(self, comm: Any, node_comm: Any, nodes: list[list[int]]) -> None:
        """``nodes``: the ranks of ``comm`` on each node, each node's in ascending order, the nodes in the
        order of their lowest rank (the same list on every rank); ``node_comm`` holds this rank's node."""
        mpi = MPI()
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.k = 0  # checks made on this board
        mine = next(node for node in nodes if self.rank in node)
        local, count = mine.index(self.rank), len(mine)
        self._local, self._count = local, count
        self.leader = local == 0
        # position of each rank's slot in the result area: node by node, each node's ranks in order
        order = [r for node in nodes for r in node]
        self._position = [0] * self.size
        for position, r in enumerate(order):
            self._position[r] = position
        # the segment: posts (parity, local rank), the published check number on a slot of its own, results
        self._done = 2 * count * SLOT_BYTES
        self._results = self._done + SLOT_BYTES
        self._done_index = self._done // 8
        total = self._results + 2 * self.size * SLOT_BYTES
        # made by every rank of the node (collective): the leaders' communicator after it, in comm's order
        segment = SharedSegment(node_comm, total)
        self._segment: SharedSegment | None = segment
        self._leaders: Any = None
        try:
            segment.touch(self._post(0, local), SLOT_BYTES)
            segment.touch(self._post(1, local), SLOT_BYTES)
            if self.leader:
                segment.touch(self._done, total - self._done)  # done = 0: nothing published yet
            segment.barrier()
        except BaseException:
            segment.close()
            raise
        self._bytes = memoryview(segment.array)
        self._mv = self._bytes.cast("q")
        self._fence = segment.fence
        self._weak = WEAK_ORDER  # fences between data and the counters: where the CPU reorders (not x86)
        self._my_values = tuple(self._values(self._post(p, local)) for p in (0, 1))
        self._my_k = tuple(self._post(p, local) // 8 for p in (0, 1))
        self._node_ks = tuple(
            tuple(self._post(p, i) // 8 for i in range(1, count)) if self.leader else () for p in (0, 1)
        )
        self._others = tuple(
            tuple(self._values(self._result(p, r)) for r in range(self.size) if r != self.rank) for p in (0, 1)
        )
        sizes = [len(node) for node in nodes]
        self._equal = len(set(sizes)) == 1
        self._exchange: Any = None
        self._specs: tuple[tuple[Any, Any], ...] = ()
        self._counts: list[int] | None = None if self._equal else [n * SLOT_BYTES for n in sizes]  # Allgatherv's
        self.native: Native | None = None  # the compiled exchange, once the leaders' communicator is made
        if self.leader:
            array = segment.array
            sends = tuple(array[self._post(p, 0) : self._post(p, 0) + count * SLOT_BYTES] for p in (0, 1))
            area = self.size * SLOT_BYTES  # one parity's result area
            receives = tuple(array[self._results + p * area : self._results + (p + 1) * area] for p in (0, 1))
            if self._equal:  # nodes of equal size: Allgather
                self._specs = tuple(([s, mpi.BYTE], [r, mpi.BYTE]) for s, r in zip(sends, receives, strict=True))
            else:
                counts = self._counts
                assert counts is not None
                displacements = [sum(counts[:j]) for j in range(len(counts))]
                self._specs = tuple(
                    ([s, mpi.BYTE], [r, (counts, displacements), mpi.BYTE])
                    for s, r in zip(sends, receives, strict=True)
                )

    def open_leaders(self) -> None:
        """The leaders' communicator (collective over ``comm``: every rank calls it, the others get none)."""
        mpi = MPI()
        leaders = self.comm.Split(0 if self.leader else mpi.UNDEFINED, self.rank)
        if self.leader:
            self._leaders = leaders
            self._exchange = leaders.Allgather if self._equal else leaders.Allgatherv
        self.native = compiled(self._plans, exchanges=True)  # the same steps in one C call, where it is here

    def _plans(self) -> list[tuple[Plan, list[Any]]]:
        """Per parity, this board as the compiled exchange sees it: post on the node; a leader waits for its
        node, exchanges with the leaders and publishes, the others wait for that; compare. Every wait yields
        from its start, as this board's Python path does (the module's docstring says why)."""
        assert self._segment is not None
        base = self._segment.array.ctypes.data
        plans = []
        for p in (0, 1):
            post = base + self._post(p, self._local)
            rows = [base + self._result(p, r) for r in range(self.size)]
            if not self.leader:
                plans.append(plan(post, post, [base + self._done], rows, spin_s=0.0))
                continue
            waits = [base + self._post(p, i) for i in range(1, self._count)]
            gather = Exchange(self._leaders, base + self._post(p, 0), base + self._result_area(p),
                              self._count * SLOT_BYTES, self._counts)  # fmt: skip
            plans.append(plan(post, post, waits, rows, gather, publish=base + self._done, spin_s=0.0))
        return plans

    def _values(self, slot: int) -> memoryview:
        """The bytes of the values of the slot at byte offset ``slot`` (a view made once: the hot path)."""
        return self._bytes[slot + 8 : slot + _DATA]

    def _post(self, parity: int, local: int) -> int:
        return (parity * self._count + local) * SLOT_BYTES

    def _result_area(self, parity: int) -> int:
        return self._results + parity * self.size * SLOT_BYTES

    def _result(self, parity: int, rank: int) -> int:
        return self._results + (parity * self.size + self._position[rank]) * SLOT_BYTES

    def post_row(self, rows: Any, parity: int) -> np.ndarray:
        """This rank's own post for checks of ``parity`` (``rows.posts``): its leader exchanges it."""
        return rows.posts[parity]  # type: ignore[no-any-return]

    def _agree_in_python(self, k: int, packed: bytes) -> bool:
        """The node's posts, the leaders' exchange, the leader's publication, then compare."""
        parity = k & 1
        mv = self._mv
        self._my_values[parity][:] = packed
        if self._weak:
            self._fence()  # the values (and data) are visible before k is
        mv[self._my_k[parity]] = k
        done = self._done_index
        if self.leader:
            for index in self._node_ks[parity]:
                if mv[index] != k:  # a post of this parity holds k - 2 until its rank posts k
                    wait_at_least(mv, index, k, 0.0)
            if self._weak:
                self._fence()  # the posts seen before their k are read after it
            send, receive = self._specs[parity]
            self._exchange(send, receive)
            if self._weak:
                self._fence()  # the results are visible before the check number is
            mv[done] = k
        else:
            if mv[done] != k:  # the leader publishes k only once this rank has posted k
                wait_at_least(mv, done, k, 0.0)
            if self._weak:
                self._fence()  # k was seen: the results written before it are read after it
        for values in self._others[parity]:  # noqa: SIM110 - the hot path: no generator
            if values != packed:
                return False
        return True

    def rows(self, dtype: Any, shape: tuple[int, ...]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Per parity, every rank's data area as an array of ``dtype`` and ``shape`` (at most DATA_BYTES),
        in rank order: views into the result area for ``agree_with``, made once by its caller."""
        assert self._segment is not None, "the board is closed"
        array = self._segment.array
        rows = _Rows(
            tuple(np.ndarray(shape, dtype, buffer=array, offset=self._result(p, r) + _DATA) for r in range(self.size))
            for p in (0, 1)
        )
        rows.posts = tuple(  # type: ignore[assignment]
            np.ndarray(shape, dtype, buffer=array, offset=self._post(p, self._local) + _DATA) for p in (0, 1)
        )
        return rows  # type: ignore[return-value]

    def posted(self) -> list[list[int]]:
        """Every rank's values of the last check, in rank order (local; valid as its rows are)."""
        mv, parity = self._mv, self.k & 1
        slots = [self._result(parity, r) // 8 for r in range(self.size)]
        return [list(mv[slot + 1 : slot + 1 + FIELDS]) for slot in slots]

    def reached(self) -> None:
        """Not known: no rank passes a check before its leader has exchanged it with every leader."""
        return None

    def close(self) -> None:
        """Free the segment and the leaders' communicator (collective over ``comm``; idempotent)."""
        if board_for(self.comm) is self:
            register(self.comm, None)
        self.native = None  # its plans point into the segment
        if self._segment is None:
            return
        self._exchange = None
        self._specs = ()
        with contextlib.suppress(BufferError):  # a view still exported: freed with the segment anyway
            for view in (*self._my_values, *(values for parity in self._others for values in parity)):
                view.release()
            self._mv.release()
            self._bytes.release()
        segment, self._segment = self._segment, None
        segment.close()
        leaders, self._leaders = self._leaders, None
        if leaders is not None:
            leaders.Free()


def open_node_mpi_board(comm: Any, node_comm: Any, nodes: list[list[int]]) -> NodeMpiBoard | None:
    """The two-level board of ``comm``, whose ranks on this node ``node_comm`` holds (a split of ``comm``
    that shares memory) and on every node ``nodes`` lists (mpigpu.job.topology.node_ranks), registered
    for ``check_signature``; None where every node holds one rank (the flat Allgather is then the
    leaders' exchange), or the segment cannot be made on every rank. Collective over ``comm``; the
    decision is the same on every rank."""
    if max(len(node) for node in nodes) < 2:
        return None
    board = made_on_every_rank(comm, lambda: NodeMpiBoard(comm, node_comm, nodes))
    if board is not None:
        board.open_leaders()
        register(comm, board)
    return board
