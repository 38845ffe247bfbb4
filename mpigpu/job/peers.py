"""The processes of a communicator's ranks on this node, and which of them have ended.

A rank that leaves the job without MPI (``os._exit``, a signal, a crash the launcher does not act
on) leaves the others waiting in their next collective until ``MPIGPU_TIMEOUT``, with a message that
does not say why. A rank can see that a rank of its own node is gone: its process no longer exists.
Every rank sends its node-mates its process id and start time (collective, at start-up); a peer is
watched only if this process sees that very process (same id and start time: not in another PID
namespace, and /proc is there), so a peer never seen cannot be reported gone. Ranks on other nodes
cannot be seen from here. Linux only (/proc); elsewhere nobody is watched.

``NodeProgress``: how many mpigpu calls each of those ranks has begun, one int64 per rank in node-shared
memory, so that a stall report names the ranks of its node that have not reached the call it waits in. The
check board holds that where it exists (every rank on one node); across nodes this does, and each node's
waiting ranks name their own node's late ones: a rank that stalls on node 1 is named by its node-mates.
"""

from __future__ import annotations

import os
from typing import Any

from mpigpu.core.typed import allgather_ints
from mpigpu.job.shm import SharedSegment

__all__ = ["NodePeers", "NodeProgress", "node_peers"]


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None if it has
    ended (gone, or a zombie: dead, its status not yet collected) or cannot be seen."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()  # after "pid (command)", which may hold spaces
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


class NodePeers:
    """The ranks of a communicator on this node that this process can watch: rank -> (pid, start time)."""

    def __init__(self, peers: dict[int, tuple[int, int]]) -> None:
        self.peers = peers

    def gone(self) -> list[tuple[int, int]]:
        """(rank, pid) of each watched peer whose process has ended."""
        return [(rank, pid) for rank, (pid, start) in self.peers.items() if _start_time(pid) != start]


def node_peers(comm: Any, node_comm: Any) -> NodePeers:
    """Exchange (rank in ``comm``, pid, start time) over ``node_comm`` (the ranks of ``comm`` on this
    node; collective) and keep the peers this process sees as they are now."""
    pid = os.getpid()
    mine = _start_time(pid)
    rows = allgather_ints(node_comm, [comm.Get_rank(), pid, -1 if mine is None else mine])
    peers = {
        rank: (peer, start) for rank, peer, start in rows if peer != pid and start >= 0 and _start_time(peer) == start
    }
    return NodePeers(peers if mine is not None else {})


class NodeProgress:
    """The count of mpigpu calls begun by each rank of a communicator on this node (collective over
    ``node_comm`` to create and to close). ``mark`` is one store; reads are for the watchdog's thread."""

    def __init__(self, comm: Any, node_comm: Any) -> None:
        self.ranks = [rank for (rank,) in allgather_ints(node_comm, [comm.Get_rank()])]  # comm's ranks, node order
        self._segment: SharedSegment | None = SharedSegment(node_comm, 8 * len(self.ranks))
        self.counts = memoryview(self._segment.array).cast("q")
        self.slot = node_comm.Get_rank()
        self.counts[self.slot] = 0
        self._segment.barrier()

    def behind(self, calls: int) -> list[int]:
        """The ranks on this node (in ``comm``) that have begun fewer than ``calls`` calls."""
        return [rank for rank, count in zip(self.ranks, self.counts.tolist(), strict=True) if count < calls]

    def ahead(self, calls: int) -> list[int]:
        """The ranks on this node (in ``comm``) that have begun more than ``calls`` calls."""
        return [rank for rank, count in zip(self.ranks, self.counts.tolist(), strict=True) if count > calls]

    def close(self) -> None:
        """Free the segment (collective over the node; idempotent)."""
        if self._segment is not None:
            self.counts.release()
            segment, self._segment = self._segment, None
            segment.close()
