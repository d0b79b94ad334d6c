"""Selection over keys that each summarise key_ratio positions (DeepSeek-V4's CSA entries:
key s covers [s r, (s + 1) r) and a query sees it once all of them are at or before it):
every index selection kind against a plain numpy reference of that rule, on random inputs
whose lengths are not multiples of the ratio or of any tile, and the entry summaries kept
while entries are rewritten against summaries built from scratch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import indexer
from indexer import HierarchicalConfig
from indexer.block_summaries import block_summaries, empty_summaries, refresh
from indexer.scoring import flat_topk, window_select
from indexer.streaming import streaming_topk
from tests.helpers import brute_force_scores, random_indexer_inputs


def reference_scores(q, w, k, q_offset, ratio):
    """float64 I[t, s], -inf unless (s + 1) ratio - 1 <= q_offset + t."""
    scores = brute_force_scores(q, w, k, q_offset=10**9)
    T, L = scores.shape
    whole = (np.arange(L)[None, :] + 1) * ratio - 1 <= (q_offset + np.arange(T))[:, None]
    return np.where(whole, scores, -np.inf)


def assert_is_top_k(got, scores, top_k, best_first=True):
    got = np.asarray(got)
    assert got.shape == (scores.shape[0], top_k) and got.dtype == np.int32
    for t, row in enumerate(got):
        visible = min(top_k, int(np.isfinite(scores[t]).sum()))
        assert (row[visible:] == -1).all(), f"row {t}: -1 past its {visible} visible keys"
        chosen = row[:visible]
        assert len(set(chosen.tolist())) == visible and np.isfinite(scores[t, chosen]).all(), \
            f"row {t} chose an invisible or repeated key: {chosen}"
        want = np.sort(scores[t][np.isfinite(scores[t])])[::-1][:visible]
        np.testing.assert_allclose(np.sort(scores[t, chosen])[::-1], want, rtol=1e-5,
                                   atol=1e-5, err_msg=f"row {t}")
        if best_first:
            assert np.all(np.diff(scores[t, chosen]) <= 1e-5), f"row {t} is not best first"


CASES = [  # T, L, top_k, q_offset, ratio
    (37, 11, 4, 0, 4),      # prefill from 0: the first 3 rows see nothing
    (21, 50, 6, 150, 4),    # a late chunk; some keys past every query
    (9, 70, 8, 130, 3),     # a ratio that is not a power of two
    (1, 40, 8, 161, 4),     # one decode row
]


@pytest.mark.parametrize("T, L, top_k, q_offset, ratio", CASES)
def test_flat_and_streaming_select_the_top_k_whole_entries(T, L, top_k, q_offset, ratio):
    q, w, k = random_indexer_inputs(T + L + ratio, T, L)
    scores = reference_scores(q, w, k, q_offset, ratio)
    flat = flat_topk(q, w, k, top_k, q_offset=q_offset, key_ratio=ratio, query_chunk=8)
    assert_is_top_k(flat, scores, top_k)
    stream = streaming_topk(q, w, k, top_k, q_offset=q_offset, key_ratio=ratio, key_tile=7,
                            query_chunk=8)
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(flat))


def test_with_the_pallas_index_scores_kernel():
    T, L, top_k, q_offset, ratio = 19, 45, 6, 160, 4
    q, w, k = random_indexer_inputs(5, T, L)
    want = flat_topk(q, w, k, top_k, q_offset=q_offset, key_ratio=ratio, backend="xla")
    got = flat_topk(q, w, k, top_k, q_offset=q_offset, key_ratio=ratio, backend="interpret")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    stream = streaming_topk(q, w, k, top_k, q_offset=q_offset, key_ratio=ratio, key_tile=16,
                            backend="interpret")
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(want))


def test_window_selects_the_last_whole_entries():
    q, w, k = random_indexer_inputs(0, 6, 8)
    got = np.asarray(window_select(q, w, k, 3, q_offset=5, key_ratio=4))
    # positions 5..10: entry 0 is whole at 3, entry 1 at 7, entry 2 at 11
    np.testing.assert_array_equal(got, [[0, -1, -1]] * 2 + [[1, 0, -1]] * 4)


def _config(**kw):
    base = dict(block_size=4, candidate_tokens=8, query_tile=1, fine_batch_size=16,
                bound_blocks=0, fast_ranking=False)
    return HierarchicalConfig(**{**base, **kw})


@pytest.mark.parametrize("T, L, top_k, q_offset, ratio, kw", [
    *(case + (dict(),) for case in CASES),
    *(case + (dict(query_tile=4, bound_blocks=1),) for case in CASES[1:3])])
def test_hierarchical_with_a_budget_covering_every_entry_is_flat(T, L, top_k, q_offset, ratio,
                                                                  kw):
    q, w, k = random_indexer_inputs(T + L + 7, T, L)
    scores = reference_scores(q, w, k, q_offset, ratio)
    config = _config(candidate_tokens=4 * (L // 4 + 1), **kw)
    got = indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=q_offset,
                                    key_ratio=ratio)
    assert_is_top_k(got, scores, top_k)


@pytest.mark.parametrize("kw", [dict(), pytest.param(dict(query_tile=4, bound_blocks=1),
                                                      marks=pytest.mark.slow)])
def test_hierarchical_within_a_budget_chooses_only_whole_entries(kw):
    """With fewer candidates than entries: never an entry whose window is not whole, never
    one twice, top_k of them wherever top_k are visible; the Pallas kernels (interpreted)
    choose the same; summaries given (as the model keeps them) change nothing."""
    T, L, top_k, q_offset, ratio = 33, 90, 6, 300, 4
    q, w, k = random_indexer_inputs(3, T, L)
    scores = reference_scores(q, w, k, q_offset, ratio)
    config = _config(candidate_tokens=12, **kw)  # 3 of 23 blocks: >= 9 whole entries
    got = np.asarray(indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=q_offset,
                                               key_ratio=ratio))
    for t, row in enumerate(got):
        chosen = row[row >= 0]
        assert len(chosen) == min(top_k, np.isfinite(scores[t]).sum())
        assert len(set(chosen.tolist())) == len(chosen) and np.isfinite(scores[t, chosen]).all()
    if not kw:  # default-tier budget: the kernels under one configuration
        pallas = indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=q_offset,
                                           key_ratio=ratio, backend="interpret")
        np.testing.assert_array_equal(np.asarray(pallas), got)
    kept = indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=q_offset,
                                     key_ratio=ratio, summaries=block_summaries(k, 4))
    np.testing.assert_array_equal(np.asarray(kept), got)


def test_exact_mode_and_a_bad_ratio_are_named():
    q, w, k = random_indexer_inputs(0, 4, 16)
    with pytest.raises(ValueError, match="exact is not available"):
        indexer.hierarchical_topk(q, w, k, 4, _config(exact=True), key_ratio=4)
    with pytest.raises(ValueError, match="key_ratio must be a positive int"):
        flat_topk(q, w, k, 4, key_ratio=0)


def test_refreshed_summaries_equal_summaries_of_the_whole_entries():
    """Entries written call by call, each call rewriting the provisional entry it left
    (random values, then the final ones): the refreshed summaries equal block_summaries of
    the whole entries alone, after every call."""
    rng = np.random.default_rng(0)
    d, B, capacity, ratio = 8, 4, 64, 4
    final = rng.standard_normal((capacity, d)).astype(np.float32)
    keys = jnp.zeros((capacity, d))
    summaries = empty_summaries(-(-capacity // B), d)
    rebuild = jax.jit(refresh, static_argnames=("n_rows", "block_size"))
    position = 0
    for T in (5, 1, 13, 2, 30, 3):
        first, whole = position // ratio, (position + T) // ratio
        n_rows = T // ratio + 1
        rows = first + np.arange(n_rows)
        values = np.where((rows < whole)[:, None], final[np.minimum(rows, capacity - 1)],
                          rng.standard_normal((n_rows, d)).astype(np.float32))
        keys = keys.at[rows].set(values, mode="drop")
        summaries = rebuild(summaries, keys, first, n_rows, whole, block_size=B)
        want = block_summaries(jnp.asarray(final[:whole]), B) if whole else None
        nb = -(-whole // B)
        for name, got in summaries._asdict().items():
            got = np.asarray(got)
            if nb:
                np.testing.assert_allclose(got[:nb], np.asarray(getattr(want, name)),
                                           rtol=1e-6, err_msg=f"{name} after {position + T}")
            np.testing.assert_array_equal(got[nb:], np.asarray(getattr(
                empty_summaries(len(got) - nb, d), name)))
        position += T
