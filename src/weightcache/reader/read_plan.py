"""Which file bytes go where: contiguous pieces of tensors grouped into segments, one read (or one host
registration) each.

A piece is a run of bytes of one file that lands contiguously in one destination tensor. Pieces of a file
whose pages touch are merged into runs; runs are cut at absolute file offsets that are multiples of the
segment size (a multiple of the page size). So a segment never crosses such a boundary, and the page-rounded
ranges of any two segments are disjoint: each can be page-locked (registered for DMA) on its own, and read
with O_DIRECT within ``segment_bytes`` of aligned buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import NamedTuple

PAGE = 4096


class Piece(NamedTuple):  # a tuple: ~1600 are made per 16 GB plan, a frozen dataclass was 4x slower to make
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int
    name: str  # destination tensor
    dst_offset: int  # byte offset in the destination tensor


@dataclass
class Segment:
    file: Path
    start: int  # first byte needed (absolute)
    end: int  # one past the last byte needed
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes that land in destinations (gaps of less than two pages between pieces are read, not kept)."""
        return sum(p.nbytes for p in self.pieces)

    def page_range(self, page: int = PAGE) -> tuple[int, int]:
        return self.start // page * page, -(-self.end // page) * page


def plan_segments(pieces: Iterable[Piece], segment_bytes: int, page: int = PAGE) -> list[Segment]:
    """Segments of at most ``segment_bytes`` (page-rounded), file by file in offset order."""
    if segment_bytes < page or segment_bytes % page:
        raise ValueError(f"segment_bytes must be a positive multiple of {page}, got {segment_bytes}")
    by_file: dict[Path, list[Piece]] = {}
    for p in pieces:
        if p.nbytes > 0:
            by_file.setdefault(p.file, []).append(p)
    out: list[Segment] = []
    for file in sorted(by_file, key=str):
        seg: Segment | None = None
        cut = -1  # the open segment's cut (its start // segment_bytes)
        for p in sorted(by_file[file], key=lambda q: q.offset):
            off, dst, left, name = p.offset, p.dst_offset, p.nbytes, p.name
            while left:
                here = off // segment_bytes
                n = min(left, (here + 1) * segment_bytes - off)
                # join the open segment if this piece starts at or before the page after its last one, in the
                # same cut; otherwise the two page-rounded ranges stay disjoint
                if seg is None or here != cut or off // page * page > -(-seg.end // page) * page:
                    seg = Segment(file, off, off + n)
                    cut = here
                    out.append(seg)
                elif off + n > seg.end:
                    seg.end = off + n
                seg.pieces.append(Piece(file, off, n, name, dst))
                off, dst, left = off + n, dst + n, left - n
    return out


def order_segments(segments: list[Segment], order: str) -> list[Segment]:
    """"file": file after file (each file read front to back); "interleave": round robin over the files, so
    that threads work on several files at once."""
    if order == "file":
        return list(segments)
    if order != "interleave":
        raise ValueError(f"order must be 'file' or 'interleave', got {order!r}")
    per_file: dict[Path, list[Segment]] = {}
    for s in segments:
        per_file.setdefault(s.file, []).append(s)
    return [s for group in zip_longest(*per_file.values()) for s in group if s is not None]


@dataclass
class SliceJob:
    """A row block of a slice copy: rows [r0, r1) along dim 0 of one packed part (``piece``) of a shard."""

    name: str
    nbytes: int  # bytes landing in the destination
    file: Path
    piece: int = 0
    r0: int = 0
    r1: int = 0


@dataclass
class ReadPlan:
    """What one fill reads: ``pieces`` go straight from the files into the destination views (by name);
    ``slices`` (strided shards, dtype casts) are copied from CPU tensors that ``read_slice(job)`` makes into
    the rows ``slice_rows(view, job)`` of their view. The reader knows nothing else of the source."""

    pieces: list[Piece]
    slices: list[SliceJob] = field(default_factory=list)
    read_slice: Callable | None = None
    slice_rows: Callable | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces) + sum(j.nbytes for j in self.slices)

    def files(self) -> set[Path]:
        return {p.file for p in self.pieces} | {j.file for j in self.slices}

    def work_items(self, segment_bytes: Callable[[Path], int], order: str = "file",
                   pieces: list[Piece] | None = None) -> list[Segment | SliceJob]:
        """Segments of ``pieces`` (default: all) of at most ``segment_bytes(file)``, in ``order``, then the
        slice jobs."""
        by_size: dict[int, list[Piece]] = {}
        for p in self.pieces if pieces is None else pieces:
            by_size.setdefault(segment_bytes(p.file), []).append(p)
        segments = [s for size, group in by_size.items() for s in plan_segments(group, size)]
        segments.sort(key=lambda s: (str(s.file), s.start))
        return [*order_segments(segments, order), *self.slices]


__all__ = ["PAGE", "Piece", "ReadPlan", "Segment", "SliceJob", "order_segments", "plan_segments"]
