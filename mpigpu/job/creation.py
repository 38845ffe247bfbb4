"""Creating and freeing mpigpu's communicators, windows and contexts one at a time in every process.

Why: with a communicator per thread, each rank creates (and at exit frees) several contexts at
once, and the order in which its threads get there differs between ranks. Freeing a shared window
is collective (a barrier), so ``finalize`` closing each rank's contexts in its own creation order
hung when rank 0 had created A before B and rank 1 B before A (1 of 10 runs of eight threads).
A process-wide lock held across the creation does not help: rank 0's thread A would hold it
waiting for rank 1's thread A, while rank 1's thread B holds rank 1's lock waiting for rank 0's
thread B.

How: ``exclusive(comm)`` proceeds only once every rank of ``comm`` holds its own process lock at
the same time. Each rank tries its lock without waiting and the ranks agree (one allreduce on
``comm``) whether all got it; if not, those that got it release it and all retry after a short
random wait (the same on every rank of ``comm``), so no rank ever waits for a lock while holding
one. Two sections on communicators
that share ranks therefore run in the same order on every rank they share: each rank's creation
order (which ``finalize`` closes in) is the same as the others', and no two threads of a process
make communicators at the same time.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

from mpigpu.core.typed import allreduce_int

__all__ = ["exclusive"]

_LOCK = threading.RLock()  # re-entrant: a context's start-up creates backends within its own section
_FIRST_WAIT_S = 0.0005  # after a failed round, wait up to this long, doubling per round ...
_LONGEST_WAIT_S = 0.05  # ... up to this long: the ranks' threads must not retry in lockstep


@contextlib.contextmanager
def exclusive(comm: Any) -> Iterator[None]:
    """Run the body while every rank of ``comm`` holds its process-wide creation lock (collective)."""
    limit = _FIRST_WAIT_S
    rng: random.Random | None = None
    while True:
        got = _LOCK.acquire(blocking=False)
        if allreduce_int(comm, int(got), "min"):
            break
        if got:
            _LOCK.release()
        if rng is None:
            # the same waits on every rank of comm, other waits on other communicators: its ranks
            # retry together, apart from the other communicators' (random waits per rank took
            # seconds to line up at 4 ranks of 8 threads each)
            rng = random.Random(allreduce_int(comm, random.getrandbits(62), "max"))
        time.sleep(rng.uniform(0, limit))
        limit = min(2 * limit, _LONGEST_WAIT_S)
    try:
        yield
    finally:
        _LOCK.release()
