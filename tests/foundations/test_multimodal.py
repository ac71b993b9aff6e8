"""The per-row layout of vision inputs (issue 32, item 1): packed rows give a model call exactly the concatenation
of their patches and grids, through row selection (sharding, micro-batching) and cat_batches of batches whose rows
hold different image counts and sizes; a row whose placeholders disagree with its grids is named."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from hyperrl.multimodal import VisionError, model_inputs, pack_vision, row_patches
from hyperrl.trajectory import TrajectoryError, cat_batches, check_vision

D, IMG = 6, 9  # patch width, the image placeholder token id


def _rows(spec, seed):
    """One (pixel_values, grids) pair per row: ``spec[b]`` = the row's images as (h, w) grids of t = 1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for imgs in spec:
        if not imgs:
            out.append((None, None))
            continue
        grid = torch.tensor([[1, h, w] for h, w in imgs])
        out.append((torch.randn(int(grid.prod(-1).sum()), D, generator=g), grid))
    return out


def _batch(rows, T=40):
    packed = pack_vision(rows)
    toks = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (_, g) in enumerate(rows):
        n = 0 if g is None else int(g.prod(-1).sum()) // 4
        toks[b, 1:1 + n] = IMG
    return TensorDict({"tokens": toks, "attention_mask": torch.ones(len(rows), T, dtype=torch.bool), **packed},
                      batch_size=[len(rows)])


grid_hw = st.tuples(st.sampled_from([2, 4]), st.sampled_from([2, 4]))
rows_spec = st.lists(st.lists(grid_hw, max_size=3), min_size=1, max_size=5)


@settings(max_examples=50, deadline=None)
@given(rows_spec, rows_spec, st.integers(0, 2**16))
def test_model_inputs_are_the_rows_patches_in_order_through_selection_and_cat(a, b, seed):
    ra, rb = _rows(a, seed), _rows(b, seed + 1)
    both = cat_batches([_batch(ra), _batch(rb)])
    rows = ra + rb

    def want(idx):
        pv = [rows[i][0] for i in idx if rows[i][0] is not None]
        gr = [rows[i][1] for i in idx if rows[i][1] is not None]
        return (torch.cat(pv), torch.cat(gr)) if pv else None

    for idx in (list(range(len(rows))), list(range(len(rows)))[::2], list(range(len(rows)))[::-1]):
        got, w = model_inputs(both[torch.tensor(idx)]), want(idx)
        if w is None:
            assert got == {}
        else:
            assert torch.equal(got["pixel_values"], w[0]) and torch.equal(got["image_grid_thw"], w[1])
    check_vision(both, image_token_id=IMG)
    assert row_patches(both["image_grid_thw"]).tolist() == [0 if r[1] is None else int(r[1].prod(-1).sum())
                                                             for r in rows]


def test_a_row_whose_placeholders_disagree_with_its_grids_is_named():
    batch = _batch(_rows([[(2, 2)], [(2, 4), (4, 4)]], 0))
    check_vision(batch, image_token_id=IMG)
    bad = batch.clone()
    bad["tokens"][1, 20] = IMG  # one placeholder too many
    with pytest.raises(TrajectoryError, match=r"row 1: 7 image placeholder tokens \(id 9\) but its image_grid_thw "
                                          r"\[\[1, 2, 4\], \[1, 4, 4\]\] takes 6"):
        check_vision(bad, image_token_id=IMG)
    with pytest.raises(VisionError, match=r"row 0: 3 patches in pixel_values, its image_grid_thw \[\[1, 2, 2\]\] "
                                          r"needs 4"):
        pack_vision([(torch.zeros(3, D), torch.tensor([[1, 2, 2]]))])
    with pytest.raises(TrajectoryError, match="image_grid_thw: missing"):
        check_vision(TensorDict({"tokens": batch["tokens"], "pixel_values": batch["pixel_values"]},
                                batch_size=[2]), image_token_id=IMG)
