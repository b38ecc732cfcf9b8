"""Which bytes of a training state each rank of a destination group needs from which rank of
a source group of another layout (TP/PP/DP differ): the layout arithmetic of a resharding
state move, pure (no torch, no MPI), so the unit tests check it on layouts no small job runs.

Every tensor of a rank's state is described in global coordinates (megatron-core's own
sharding metadata: a ShardedTensor's key, global shape and offset, trainer/megatron/swap.py
builds the `Block`s from `sharded_state_dict()`): a `Block` is the part of one global 2-D tensor
(leading layer axes folded into the tensor's identity, 1-D tensors as one column) that rows
[r0, r1) of a local tensor hold, of which the rank keeps the flat range [f0, f1) (the
DistributedOptimizer gives each data-parallel rank a flat range of a parameter's main copy and
Adam moments; a parameter itself is the whole range). A flat range of a row-major tensor is
at most three rectangles (a partial first row, whole rows, a partial last row): `regions`.

`plan` covers every region of every destination block with rectangles of source regions of
the same tensor, each destination byte exactly once, preferring source ranks in an order
rotated by the destination's index (so data-parallel replicas and the TP ranks that hold a
replicated norm share the sending). `locate` turns a piece back into a strided view of a rank's
flat local tensor: (offset, rows, cols, row stride).
"""
from __future__ import annotations

from dataclasses import dataclass

Rect = tuple[int, int, int, int]
"""(row0, row1, col0, col1) of a global 2-D tensor, half-open."""


@dataclass(frozen=True)
class Block:
    """Part of one global tensor that one rank holds (see the module doc)."""
    tensor: tuple               # identity: (kind, megatron key, leading global offsets)
    shape: tuple[int, int]      # the global tensor's (rows, cols)
    offset: tuple[int, int]     # global (row, col) of the block's first local row, column 0
    rows: tuple[int, int]       # local rows [r0, r1) of the local tensor this block is
    cols: int                   # the local tensor's row length
    flat: tuple[int, int]       # flat range [f0, f1) of the local tensor this rank keeps
    itemsize: int               # bytes per element
    slot: int = 0               # which of the rank's flat local tensors holds it

    def __post_init__(self):
        r0, r1 = self.rows
        if not (0 <= r0 <= r1 and 0 <= self.flat[0] <= self.flat[1] and self.cols > 0):
            raise ValueError(f"block of {self.tensor}: bad rows {self.rows} / flat {self.flat} / cols {self.cols}")
        if self.offset[0] + r1 - r0 > self.shape[0] or self.offset[1] + self.cols > self.shape[1]:
            raise ValueError(f"block of {self.tensor}: outside its global shape {self.shape}")


@dataclass(frozen=True)
class Piece:
    """Rectangle `rect` of global tensor `tensor` goes from source rank `src` to destination rank `dst`."""
    src: int
    dst: int
    tensor: tuple
    rect: Rect
    itemsize: int

    @property
    def nbytes(self) -> int:
        return (self.rect[1] - self.rect[0]) * (self.rect[3] - self.rect[2]) * self.itemsize


def _local_rects(b: Block) -> list[Rect]:
    """The flat range of `b` cut to its rows, as local rectangles (at most three)."""
    f0, f1 = max(b.flat[0], b.rows[0] * b.cols), min(b.flat[1], b.rows[1] * b.cols)
    if f0 >= f1:
        return []
    c = b.cols
    first, last = f0 // c, (f1 - 1) // c
    if first == last:
        return [(first, first + 1, f0 % c, (f1 - 1) % c + 1)]
    out = []
    if f0 % c:
        out.append((first, first + 1, f0 % c, c))
        first += 1
    whole_end = last + 1 if f1 % c == 0 else last
    if whole_end > first:
        out.append((first, whole_end, 0, c))
    if f1 % c:
        out.append((last, last + 1, 0, f1 % c))
    return out


def regions(b: Block) -> list[Rect]:
    """The global rectangles `b` holds."""
    dr, dc = b.offset[0] - b.rows[0], b.offset[1]
    return [(r0 + dr, r1 + dr, c0 + dc, c1 + dc) for r0, r1, c0, c1 in _local_rects(b)]


def _cut(a: Rect, b: Rect) -> Rect | None:
    r = (max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3]))
    return r if r[0] < r[1] and r[2] < r[3] else None


def _minus(a: Rect, c: Rect) -> list[Rect]:
    """`a` without its part `c` (c inside a): up to four rectangles."""
    out = [(a[0], c[0], a[2], a[3]), (c[1], a[1], a[2], a[3]),
           (c[0], c[1], a[2], c[2]), (c[0], c[1], c[3], a[3])]
    return [r for r in out if r[0] < r[1] and r[2] < r[3]]


def plan(src: list[list[Block]], dst: list[list[Block]]) -> list[Piece]:
    """Pieces covering every destination rank's regions from the source ranks' (each
    destination byte once). A region no source holds: ValueError naming the tensor."""
    held: dict[tuple, list[tuple[int, Rect, int]]] = {}
    for s, blocks in enumerate(src):
        for b in blocks:
            held.setdefault(b.tensor, []).extend((s, r, b.itemsize) for r in regions(b))
    pieces: list[Piece] = []
    for d, blocks in enumerate(dst):
        for b in blocks:
            sources = sorted(held.get(b.tensor, []), key=lambda h: (h[0] - d) % max(1, len(src)))
            for want in regions(b):
                todo = [want]
                for s, have, size in sources:
                    if size != b.itemsize:
                        raise ValueError(f"{b.tensor}: {size} bytes per element at the source, {b.itemsize} here")
                    left = []
                    for r in todo:
                        c = _cut(r, have)
                        if c is None:
                            left.append(r)
                            continue
                        pieces.append(Piece(s, d, b.tensor, c, size))
                        left += _minus(r, c)
                    todo = left
                    if not todo:
                        break
                if todo:
                    raise ValueError(f"resharding: rows/cols {todo[0]} of {b.tensor} are held by no source rank")
    return pieces


def locate(blocks: list[Block], tensor: tuple, rect: Rect) -> tuple[int, int, int, int, int]:
    """(slot, element offset in that flat local tensor, rows, cols, row stride) of the view of
    `rect` of `tensor` among this rank's `blocks`."""
    for b in blocks:
        if b.tensor != tensor:
            continue
        for g in regions(b):
            if _cut(g, rect) == rect:
                lr = rect[0] - b.offset[0] + b.rows[0]
                lc = rect[2] - b.offset[1]
                return b.slot, lr * b.cols + lc - b.flat[0], rect[1] - rect[0], rect[3] - rect[2], b.cols
    raise ValueError(f"resharding: {rect} of {tensor} is not held here")


def received(pieces: list[Piece], rank: int) -> int:
    """Bytes the destination `rank` receives."""
    return sum(p.nbytes for p in pieces if p.dst == rank)


def held_bytes(blocks: list[Block]) -> int:
    """Bytes a rank's blocks hold (what it must receive, no more)."""
    return sum((r[1] - r[0]) * (r[3] - r[2]) * b.itemsize for b in blocks for r in regions(b))
