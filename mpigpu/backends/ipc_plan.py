"""How the ipc backend cuts one allreduce into kernel launches: pure arithmetic, no CUDA.

Every rank must compute exactly the same launches for the same element count (the kernels of the
ranks synchronise block by block), so everything here is a function of the count, the element
size, the number of ranks and constants shared with ``kernels/ipc.cu``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "FLAG_TEMP_RESULT",
    "MAX_BLOCKS",
    "MAX_RANKS",
    "MAX_THREADS",
    "PACK_BYTES",
    "SIGNAL_BYTES",
    "STAGE_BYTES",
    "TABLE_OFFSET",
    "TWO_SHOT_MIN_BYTES",
    "Launch",
    "allocation_bytes",
    "default_two_shot_min",
    "plan_launches",
]

# Mirrors of the #defines in kernels/ipc.cu (tests/backends/test_ipc_unit.py checks that they agree).
MAX_RANKS = 8  # IPC_MAX_RANKS: ranks of one node the kernel can combine
MAX_BLOCKS = 64  # IPC_MAX_BLOCKS: flag slots per rank
SIGNAL_BYTES = 32768  # IPC_SIGNAL_BYTES: flags and tables at the start of each rank's allocation
TABLE_OFFSET = 16  # IPC_TABLE_OFFSET: where the host writes the peers' addresses (u64[MAX_RANKS])
MAX_THREADS = 512  # IPC_MAX_THREADS: threads per block
PACK_BYTES = 16  # one vector load: each thread moves 16-byte packs of elements
FLAG_TEMP_RESULT = 1  # IPC_FLAG_TEMP_RESULT: direct, in place, one-shot: reduce via the staging buffer

STAGE_BYTES = 8 << 20  # each of the two staging buffers; larger messages go in pieces of this size
DEFAULT_MAX_BLOCKS = 32  # blocks per launch (one per SM at most), enough to saturate NVLink reads
TWO_SHOT_MIN_BYTES = 512 << 10  # from here on (3+ ranks) reduce-scatter + all-gather beats one-shot


@dataclass(frozen=True)
class Launch:
    """One kernel launch: elements first..first+count-1, one-shot (slice 0) or two-shot."""

    first: int  # element offset of this piece in the message
    count: int  # elements in this piece
    slice: int  # two-shot: elements per rank's slice (a whole number of packs); 0 = one-shot
    blocks: int
    threads: int


def allocation_bytes(stage_bytes: int = STAGE_BYTES) -> int:
    """Bytes of the registered allocation of each rank: signals, then two staging buffers."""
    return SIGNAL_BYTES + 2 * stage_bytes


def default_two_shot_min(nranks: int) -> int | None:
    """Message size from which two-shot is used; None (never) for 2 ranks, where one-shot reads
    the same bytes over NVLink as two-shot and needs one barrier fewer."""
    return TWO_SHOT_MIN_BYTES if nranks > 2 else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan_launches(
    count: int,
    itemsize: int,
    nranks: int,
    *,
    stage_bytes: int = STAGE_BYTES,
    two_shot_min_bytes: int | None = None,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> tuple[Launch, ...]:
    """The launches that reduce ``count`` elements of ``itemsize`` bytes over ``nranks`` ranks.

    Pieces hold at most ``stage_bytes`` (one staging buffer). A piece of at least
    ``two_shot_min_bytes`` (None: never) uses two-shot. Threads and blocks grow with the work of
    one rank (the whole piece for one-shot, one slice for two-shot) up to ``max_blocks`` blocks of
    ``MAX_THREADS`` threads; small messages get one block of one warp."""
    if not 1 <= nranks <= MAX_RANKS:
        raise ValueError(f"nranks must be 1..{MAX_RANKS}, not {nranks}")
    if itemsize not in (1, 2, 4, 8) or stage_bytes % PACK_BYTES or stage_bytes < PACK_BYTES:
        raise ValueError(f"bad itemsize {itemsize} or stage_bytes {stage_bytes}")
    if not 1 <= max_blocks <= MAX_BLOCKS:
        raise ValueError(f"max_blocks must be 1..{MAX_BLOCKS}, not {max_blocks}")
    per_pack = PACK_BYTES // itemsize
    piece = stage_bytes // itemsize
    launches = []
    for first in range(0, count, piece):
        n = min(piece, count - first)
        two_shot = two_shot_min_bytes is not None and nranks > 1 and n * itemsize >= two_shot_min_bytes
        slice_ = _ceil_div(_ceil_div(n, nranks), per_pack) * per_pack if two_shot else 0
        packs = _ceil_div(slice_ if two_shot else n, per_pack)
        threads = min(MAX_THREADS, _ceil_div(packs, 32) * 32)
        blocks = min(max_blocks, _ceil_div(packs, threads))
        launches.append(Launch(first, n, slice_, blocks, threads))
    return tuple(launches)
