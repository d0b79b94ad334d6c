import numpy as np
import pytest

import indexer
from tests.helpers import brute_force_scores, random_indexer_inputs


@pytest.mark.parametrize("T,L,q_offset", [(37, 37, 0), (16, 80, 64), (5, 200, 3)])
def test_index_scores_match_brute_force(T, L, q_offset):
    q, w, k = random_indexer_inputs(T + L + q_offset, T, L)
    got = np.asarray(indexer.index_scores(q, w, k, q_offset=q_offset))
    want = brute_force_scores(q, w, k, q_offset)
    assert got.shape == (T, L) and got.dtype == np.float32
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,L,top_k,q_offset,chunk", [
    (50, 50, 8, 0, 16),      # T not a multiple of the query chunk; early rows see < top_k keys
    (33, 300, 32, 267, 7),   # a late query chunk (prefill of the tail of a context)
    (20, 64, 64, 10, 512),   # top_k >= visible everywhere: -1 padding
    (3, 10, 16, 0, 2),       # top_k > L
])
def test_flat_topk_equals_brute_force(T, L, top_k, q_offset, chunk):
    q, w, k = random_indexer_inputs(7 * T + L, T, L)
    got = np.asarray(indexer.flat_topk(q, w, k, top_k, q_offset=q_offset, query_chunk=chunk))
    scores = brute_force_scores(q, w, k, q_offset)
    assert got.shape == (T, top_k) and got.dtype == np.int32
    for t in range(T):
        visible = min(top_k, q_offset + t + 1, L)
        row = got[t]
        assert (row[visible:] == -1).all(), "padding must be -1 past the visible count"
        sel = row[:visible]
        assert (sel >= 0).all() and len(set(sel.tolist())) == visible
        assert (sel <= q_offset + t).all(), "selected a future token"
        # Same set up to ties: the selected scores are exactly the top `visible` scores.
        want_vals = np.sort(scores[t])[::-1][:visible]
        np.testing.assert_allclose(np.sort(scores[t, sel])[::-1], want_vals, rtol=1e-4, atol=1e-4)
        # Best first.
        assert np.all(np.diff(scores[t, sel]) <= 1e-4)


def test_flat_topk_rejects_bad_top_k():
    q, w, k = random_indexer_inputs(0, 4, 4)
    with pytest.raises(ValueError, match="top_k"):
        indexer.flat_topk(q, w, k, 0)


def test_recall_and_iou_on_hand_made_example():
    ref = np.array([[0, 1, 2, 3], [4, 5, -1, -1]])
    sel = np.array([[0, 1, 9, 8], [5, 4, 7, -1]])
    assert indexer.recall(sel, ref) == pytest.approx((2 / 4 + 2 / 2) / 2)
    assert indexer.iou(sel, ref) == pytest.approx((2 / 6 + 2 / 3) / 2)


def test_default_query_chunk_follows_the_backend_and_the_score_budget():
    from indexer.scoring import (
        PALLAS_QUERY_CHUNK,
        XLA_MIN_QUERY_CHUNK,
        XLA_QUERY_CHUNK,
        XLA_SCORE_BYTES,
        default_query_chunk,
    )

    assert default_query_chunk(8192, 4, "xla") == XLA_QUERY_CHUNK
    assert default_query_chunk(8192, 4, "pallas") == PALLAS_QUERY_CHUNK
    long = default_query_chunk(1 << 18, 4, "xla")  # the per-head logits fit the budget
    assert long < XLA_QUERY_CHUNK and long * 4 * 4 * (1 << 18) <= XLA_SCORE_BYTES
    assert default_query_chunk(1 << 30, 4, "xla") == XLA_MIN_QUERY_CHUNK


def test_flat_topk_chunking_does_not_change_the_selection():
    q, w, k = random_indexer_inputs(11, 70, 300)
    default = np.asarray(indexer.flat_topk(q, w, k, 24, q_offset=230))
    np.testing.assert_array_equal(
        default, np.asarray(indexer.flat_topk(q, w, k, 24, q_offset=230, query_chunk=512)))
    with pytest.raises(ValueError, match="query_chunk"):
        indexer.flat_topk(q, w, k, 24, query_chunk=0)


@pytest.mark.parametrize("T,L,top_k,q_offset,chunk", [
    (50, 50, 8, 0, 16), (33, 300, 32, 267, 7), (20, 64, 64, 10, 512), (3, 10, 16, 0, 2),
])
def test_flat_fast_ranking_keeps_the_same_set(T, L, top_k, q_offset, chunk):
    """FlatConfig.fast_ranking (threshold_topk): lax.top_k's set, -1 padding last."""
    from indexer.config import FlatConfig
    from indexer.scoring import flat_select

    q, w, k = random_indexer_inputs(7 * T + L + 1, T, L)
    exact = np.asarray(indexer.flat_topk(q, w, k, top_k, q_offset=q_offset, query_chunk=chunk))
    fast = np.asarray(indexer.flat_topk(q, w, k, top_k, q_offset=q_offset, query_chunk=chunk,
                                        fast_ranking=True))
    via_kind = np.asarray(flat_select(q, w, k, top_k, q_offset=q_offset,
                                      config=FlatConfig(fast_ranking=True)))
    assert fast.shape == exact.shape and fast.dtype == np.int32
    for t in range(T):
        visible = int((exact[t] >= 0).sum())
        assert (fast[t, visible:] == -1).all() and (fast[t, :visible] >= 0).all()
        assert set(fast[t].tolist()) == set(exact[t].tolist()) == set(via_kind[t].tolist())


def test_flat_config_is_the_flat_kinds_settings():
    from indexer.config import FlatConfig
    from indexer.selection import selection_kind
    from model import get_config

    assert selection_kind("flat").config is FlatConfig
    config = get_config("tiny").with_settings("flat", fast_ranking=True)
    assert config.settings("flat") == FlatConfig(fast_ranking=True)
    with pytest.raises(ValueError, match="FlatConfig.fast_ranking must be true or false"):
        FlatConfig(fast_ranking="yes")
