"""The resharding plan (runtime/reshard.py): layouts of TP x DP with flat optimizer ranges cut
mid-row, moved by the plan's pieces with numpy and compared with what each destination rank
must hold; every destination byte once, from a rank that holds it."""
import itertools

import numpy as np
import pytest

from flexmarl_hpc.runtime.reshard import Block, locate, plan, received, held_bytes, regions

# global tensors: a column-parallel (rows split), a row-parallel (cols split), a replicated norm
SHAPES = {"col": (12, 5), "row": (6, 8), "norm": (7, 1)}


def layout(tp: int, dp: int, cut: int = 0) -> list[list[Block]]:
    """Ranks (tp_rank, dp_rank) in order: each holds its TP shard of every parameter whole
    ("param", replicated over DP) and a flat range of its main copy ("main", split over DP at
    boundaries shifted by `cut` so they fall mid-row)."""
    ranks = []
    for t, d in itertools.product(range(tp), range(dp)):
        blocks = []
        for name, (R, C) in SHAPES.items():
            lr, lc, off = (R // tp, C, (t * R // tp, 0)) if name == "col" else \
                (R, C // tp, (0, t * C // tp)) if name == "row" else (R, C, (0, 0))
            n = lr * lc
            edges = [0] + [min(n, max(0, k * n // dp + cut)) for k in range(1, dp)] + [n]
            blocks.append(Block(("param", name, ()), (R, C), off, (0, lr), lc, (0, n), 2))
            blocks.append(Block(("main", name, ()), (R, C), off, (0, lr), lc, (edges[d], edges[d + 1]), 4))
        ranks.append(blocks)
    return ranks


def flats(blocks: list[Block], full: dict) -> dict:
    """Each block's flat local tensor filled from the global tensors `full`."""
    out = {}
    for b in blocks:
        a = out.setdefault(b.tensor, np.full(b.flat[1] - b.flat[0], -1.0))
        for r in regions(b):
            slot, off, h, w, stride = locate([b], b.tensor, r)
            view = np.lib.stride_tricks.as_strided(a[off:], (h, w), (stride * 8, 8))
            view[:] = full[b.tensor[1]][r[0]:r[1], r[2]:r[3]]
    return out


@pytest.mark.parametrize("src,dst", [((2, 1, 0), (1, 2, 0)), ((2, 2, 3), (1, 3, 1)), ((4, 1, 0), (2, 3, 2)),
                                     ((1, 3, 2), (2, 1, 0)), ((2, 1, 0), (2, 1, 0))])
def test_the_plan_moves_every_destination_byte_once_from_a_holder(src, dst):
    rng = np.random.default_rng(0)
    full = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    S, D = layout(*src), layout(*dst)
    pieces = plan(S, D)
    have = [flats(blocks, full) for blocks in S]
    got = [{b.tensor: np.full(b.flat[1] - b.flat[0], np.nan) for b in blocks} for blocks in D]
    for p in pieces:
        _, so, h, w, ss = locate(S[p.src], p.tensor, p.rect)
        _, do, _, _, ds = locate(D[p.dst], p.tensor, p.rect)
        a, b = have[p.src][p.tensor], got[p.dst][p.tensor]
        dview = np.lib.stride_tricks.as_strided(b[do:], (h, w), (ds * 8, 8))
        assert np.isnan(dview).all(), "a destination byte arrived twice"
        dview[:] = np.lib.stride_tricks.as_strided(a[so:], (h, w), (ss * 8, 8))
    for d, blocks in enumerate(D):
        want = flats(blocks, full)
        for k in want:
            np.testing.assert_array_equal(got[d][k], want[k])
        assert received(pieces, d) == held_bytes(blocks)        # its shard, not the state


def test_replicas_share_the_sending():
    """A DP2 source: both replicas hold every parameter; destinations take from both."""
    pieces = plan(layout(1, 2), layout(1, 2))
    assert {p.src for p in pieces if p.tensor[0] == "param"} == {0, 1}


def test_a_region_no_source_holds_is_refused():
    S = [[b for b in layout(2, 1)[0]], [b for b in layout(2, 1)[1] if b.tensor[1] != "row"]]
    with pytest.raises(ValueError, match=r"held by no source rank"):
        plan(S, layout(1, 1))


def test_a_flat_range_is_at_most_three_rectangles():
    b = Block(("main", "w", ()), (10, 4), (2, 0), (0, 5), 4, (3, 17), 4)
    assert regions(b) == [(2, 3, 3, 4), (3, 6, 0, 4), (6, 7, 0, 1)]
    assert Block(("m", "w", ()), (10, 4), (0, 0), (2, 4), 4, (0, 20), 4).flat == (0, 20)
    assert regions(Block(("m", "w", ()), (10, 4), (0, 0), (2, 4), 4, (0, 20), 4)) == [(0, 2, 0, 4)]


def test_pieces_of_mixed_dtypes_travel_packed_and_aligned():
    """state_swap.pack_pieces / unpack_pieces (what send_pieces / recv_pieces send): a bf16
    parameter of odd length, then its fp32 main copy, in one message; the fp32 piece must
    start aligned (unaligned, torch refuses the fp32 view of the bytes)."""
    import torch
    from flexmarl_hpc.runtime.state_swap import _index, pack_pieces, unpack_pieces
    blocks = [Block(("param", "n", ()), (7, 1), (0, 0), (0, 7), 1, (0, 7), 2, 0),
              Block(("main", "n", ()), (7, 1), (0, 0), (0, 7), 1, (0, 7), 4, 1)]
    src = [torch.arange(7, dtype=torch.bfloat16), torch.arange(7, dtype=torch.float32) / 3]
    dst = [torch.zeros(7, dtype=torch.bfloat16), torch.zeros(7, dtype=torch.float32)]
    pieces = plan([blocks], [blocks])
    assert [p.nbytes for p in pieces] == [14, 28]
    buf = pack_pieces(pieces, _index(blocks), src)
    unpack_pieces(buf, pieces, _index(blocks), dst)
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
