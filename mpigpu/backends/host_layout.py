"""The host backend's layout: how the node-shared segment is divided (``SegmentLayout``) and how
one message maps onto its ring of chunk positions (``ChunkPlan``). Plain arithmetic, the same on
every rank of a node; no MPI, no CUDA."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

__all__ = ["ALIGN", "PAGE", "ChunkPlan", "SegmentLayout", "round_up", "split_even"]

PAGE = mmap.PAGESIZE
ALIGN = 16  # slice boundaries (bytes): the kernel's 16-byte loads stay aligned


def split_even(count: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``count`` items, each start a multiple of ``align``
    (the last ranges may be short or empty)."""
    step = -(-count // parts)
    step = -(-step // align) * align
    return [(min(count, i * step), min(count, (i + 1) * step)) for i in range(parts)]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets of every area in the node segment (identical on every rank of the node).

    [latency route: 2 parities x (n input slots + n output slots) of ``small`` bytes]
    [pipeline: n slots of ``stride`` bytes][result: ``stride`` bytes]
    [partial results in the accumulator type: 2 x ``stride`` bytes, only with several nodes]

    A pipeline divides ``stride`` into ring positions of its own size; ``at`` is a byte offset into
    a slot (and the same offset into the result area, twice it into the partial area).
    """

    ranks: int
    stride: int
    small: int
    partial: bool

    @property
    def small_area(self) -> int:
        return 4 * self.ranks * self.small

    def small_in(self, parity: int, rank: int) -> int:
        return (2 * parity * self.ranks + rank) * self.small

    def small_out(self, parity: int, rank: int) -> int:
        return ((2 * parity + 1) * self.ranks + rank) * self.small

    def slot(self, rank: int, at: int) -> int:
        return self.small_area + rank * self.stride + at

    def result(self, at: int) -> int:
        return self.small_area + self.ranks * self.stride + at

    def partial_at(self, at: int) -> int:
        return self.small_area + (self.ranks + 1) * self.stride + 2 * at

    @property
    def total(self) -> int:
        return self.small_area + (self.ranks + 1 + (2 if self.partial else 0)) * self.stride

    @staticmethod
    def max_stride(ranks: int, small: int, partial: bool, pool_bytes: int) -> int:
        """The largest page-multiple stride whose segment stays within ``pool_bytes`` per rank."""
        budget = pool_bytes * ranks - 4 * ranks * small
        return max(0, budget // (ranks + 1 + (2 if partial else 0))) // PAGE * PAGE


@dataclass(frozen=True)
class ChunkPlan:
    """How one message maps onto the ring: chunk k covers elements [k*chunk, ...)."""

    count: int
    chunk: int  # elements per chunk
    ranks: int  # ranks on this node
    align: int  # slice boundary, in elements

    @property
    def chunks(self) -> int:
        return -(-self.count // self.chunk)

    def span(self, k: int) -> tuple[int, int]:
        return k * self.chunk, min(self.count, (k + 1) * self.chunk)

    def slices(self, k: int) -> list[tuple[int, int]]:
        """Each local rank's slice of chunk k, relative to the chunk."""
        e0, e1 = self.span(k)
        return split_even(e1 - e0, self.ranks, self.align)
