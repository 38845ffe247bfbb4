"""A rank sees that a rank of its node has ended (issue 39: ``os._exit(0)`` on one rank left the other
waiting until MPIGPU_TIMEOUT): NodePeers tells an ended process (gone, or a zombie) from a live one,
and never watches a process it could not see at start-up (another PID namespace, a reused pid)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mpigpu.job.peers import NodePeers, _start_time, node_peers

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")


def test_a_live_process_has_a_start_time_and_an_ended_one_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = _start_time(child.pid)
        assert start is not None and start > 0
        peers = NodePeers({1: (child.pid, start)})
        assert peers.gone() == []
        child.kill()
        deadline = time.monotonic() + 10
        while _start_time(child.pid) is not None and time.monotonic() < deadline:  # a zombie until waited for
            time.sleep(0.01)
        assert peers.gone() == [(1, child.pid)], "an ended, not yet collected process (a zombie) is gone"
    finally:
        child.kill()
        child.wait()
    assert peers.gone() == [(1, child.pid)]


def test_a_reused_pid_is_a_different_process() -> None:
    mine = _start_time(os.getpid())
    assert mine is not None
    assert NodePeers({3: (os.getpid(), mine + 1)}).gone() == [(3, os.getpid())]


def test_node_peers_keeps_only_processes_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows of three node-mates: one seen as it reported itself, one whose pid here is another
    process (its own PID namespace), one that reported no start time (no /proc there)."""
    import mpigpu.job.peers as peers_module

    mine = _start_time(os.getpid())
    parent = os.getppid()
    rows = [(0, os.getpid(), mine), (1, parent, _start_time(parent)), (2, 1, 12345), (3, parent, -1)]
    monkeypatch.setattr(peers_module, "allgather_ints", lambda comm, values: rows)

    class Comm:
        def Get_rank(self) -> int:
            return 0

    assert node_peers(Comm(), None).peers == {1: (parent, _start_time(parent))}
