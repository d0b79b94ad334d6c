"""Hierarchical indexer: exact mode equals flat, budgets, forced blocks, padding, bounds."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import indexer
from indexer import HierarchicalConfig
from indexer.block_summaries import block_summaries
from indexer.candidates import forced_blocks, table_slots, tile_candidate_union
from indexer.exact import block_upper_bounds
from indexer.scoring import threshold_topk
from tests.helpers import brute_force_scores, random_indexer_inputs


def assert_equals_flat_topk(got, q, w, k, top_k, q_offset=0, best_first=True):
    """Same contract and same selected scores as the exact top_k (sets equal up to ties);
    best_first=False: in any order (fast ranking)."""
    got = np.asarray(got)
    scores = brute_force_scores(q, w, k, q_offset)
    assert got.shape == (q.shape[0], top_k) and got.dtype == np.int32
    for t in range(q.shape[0]):
        visible = min(top_k, q_offset + t + 1, k.shape[0])
        row = got[t]
        assert (row[visible:] == -1).all(), f"row {t}: padding must be -1 past {visible}"
        sel = row[:visible]
        assert (sel >= 0).all() and len(set(sel.tolist())) == visible, f"row {t}: {sel}"
        assert (sel <= q_offset + t).all(), f"row {t} selected a future token"
        want = np.sort(scores[t])[::-1][:visible]
        np.testing.assert_allclose(np.sort(scores[t, sel])[::-1], want, rtol=1e-4, atol=1e-4,
                                   err_msg=f"row {t}")
        if best_first:
            assert np.all(np.diff(scores[t, sel]) <= 1e-4), f"row {t} is not best first"


def cfg(**kw):
    base = dict(block_size=8, candidate_tokens=16, query_tile=1, fine_batch_size=16,
                bound_blocks=0, refine_blocks=2, fast_ranking=False)
    base.update(kw)
    return HierarchicalConfig(**base)


@pytest.mark.parametrize("T,L,top_k,q_offset,kw", [
    (40, 40, 8, 0, dict()),                                    # prefill from 0, per query
    (24, 100, 16, 76, dict(query_tile=4, block_size=7)),        # block not dividing L, tiles
    # default-tier time budget: these two in the slow tier
    pytest.param(21, 90, 8, 69, dict(query_tile=3, fine_batch_size=9,
                                     share_tile_candidates=True), marks=pytest.mark.slow),
    pytest.param(16, 64, 12, 48, dict(query_tile=8, bound_blocks=1, refine_blocks=1,
                                      tile_candidate_tokens=16),  # union cut, bound slots
                 marks=pytest.mark.slow),
    (5, 33, 40, 28, dict(candidate_tokens=40)),                 # top_k > visible: -1 padding
])
def test_exact_mode_equals_flat_on_random_inputs(T, L, top_k, q_offset, kw):
    q, w, k = random_indexer_inputs(T * L + top_k, T, L)
    got, stats = indexer.hierarchical_topk_with_stats(
        q, w, k, top_k, cfg(exact=True, **kw), q_offset=q_offset)
    assert_equals_flat_topk(got, q, w, k, top_k, q_offset)
    assert 0.0 <= float(stats["rescored_fraction"]) <= float(stats["scored_fraction"]) <= 1.0
    floor = indexer.topk_block_fraction(got, cfg(**kw).block_size, q_offset + np.arange(T))
    assert floor <= float(stats["scored_fraction"]) + 1e-6


def _needle_inputs(seed=0, T=8, L=96, d=16, H=2, far=21):
    """Keys that make pooled means misleading: one far token (position `far`) with a huge
    score for every query, in a block whose other keys point away from the queries."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d).astype(np.float32)
    u /= np.linalg.norm(u)
    q = (rng.standard_normal((T, H, d)) * 0.3 + u).astype(np.float32)
    w = np.abs(rng.standard_normal((T, H))).astype(np.float32) + 0.1
    k = rng.standard_normal((L, d)).astype(np.float32)
    block = far // 8
    k[block * 8:(block + 1) * 8] -= 3 * u  # the needle's neighbours score low
    k[far] = 20 * u
    return q, w, k


def test_exact_mode_finds_a_single_far_token_that_block_means_hide():
    q, w, k = _needle_inputs()
    T, L = q.shape[0], k.shape[0]
    top_k, q_offset = 8, L - T
    flat = np.asarray(indexer.flat_topk(q, w, k, top_k, q_offset=q_offset))
    assert (flat[:, 0] == 21).all(), "the needle is every query's best token"
    approx = np.asarray(indexer.hierarchical_topk(q, w, k, top_k, cfg(), q_offset=q_offset))
    assert not (approx == 21).any(), "pooled means alone miss the needle (test premise)"
    got, stats = indexer.hierarchical_topk_with_stats(
        q, w, k, top_k, cfg(exact=True), q_offset=q_offset)
    assert_equals_flat_topk(got, q, w, k, top_k, q_offset)
    assert 0.0 < float(stats["rescored_fraction"]) < 1.0
    # One bound slot (upper bounds from min/max keys) also catches it without exact mode.
    bound = indexer.hierarchical_topk(q, w, k, top_k, cfg(bound_blocks=1, candidate_tokens=24),
                                      q_offset=q_offset)
    assert (np.asarray(bound)[:, 0] == 21).all()


@pytest.mark.parametrize("case", ["negative_weights", "mixed_sign_weights", "equal_keys"])
def test_exact_mode_on_adversarial_inputs(case):
    T, L, top_k = 12, 72, 8
    q, w, k = (a.copy() for a in random_indexer_inputs(5, T, L))
    if case == "negative_weights":
        w = -np.abs(w)  # best tokens are those with the most negative logits
    elif case == "mixed_sign_weights":
        w = w * 5.0
        q[:, 0] *= 4.0
    else:
        k = np.broadcast_to(k[:1], k.shape).copy()  # every score ties
    got = indexer.hierarchical_topk(q, w, k, top_k, cfg(exact=True, query_tile=4),
                                    q_offset=L - T)
    assert_equals_flat_topk(got, q, w, k, top_k, L - T)


@pytest.mark.parametrize("kw", [dict(), dict(query_tile=4), dict(query_tile=4, bound_blocks=2),
                                dict(query_tile=4, share_tile_candidates=True)])
def test_a_budget_covering_all_tokens_equals_flat(kw):
    T, L, top_k = 20, 60, 8
    q, w, k = random_indexer_inputs(11, T, L)
    config = cfg(candidate_tokens=64, **kw)
    got = indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=L - T)
    assert_equals_flat_topk(got, q, w, k, top_k, L - T)
    ratio = indexer.hierarchical_topk(q, w, k, top_k, cfg(candidate_tokens=None,
                                                          coarse_keep_ratio=1.0), q_offset=L - T)
    assert_equals_flat_topk(ratio, q, w, k, top_k, L - T)


def test_threshold_ranking_keeps_the_top_k_sets():
    rng = np.random.default_rng(1)
    scores = (rng.standard_normal((7, 300)) * 10).astype(np.float32)
    scores[:, 250:] = -np.inf
    scores[1] = -np.inf  # nothing visible
    scores[2, 5:] = -np.inf  # fewer than top_k visible
    scores[3] = 0.0  # all tied: lower columns first, as lax.top_k
    scores[4, [3, 7, 200]] = 99.0
    scores[5, 100:] = scores[5, 100:] + 1e-3  # near-ties, far below the window's width
    values, cols = (np.asarray(x) for x in threshold_topk(jnp.asarray(scores), 20))
    want_values, want_cols = (np.asarray(x) for x in jax.lax.top_k(jnp.asarray(scores), 20))
    assert (values[1] == -np.inf).all()
    np.testing.assert_array_equal(np.sort(cols[2, :5]), np.arange(5))
    assert (values[2, 5:] == -np.inf).all()
    np.testing.assert_array_equal(cols[3], np.arange(20))
    for row in (0, 4, 5, 6):
        assert set(cols[row]) == set(want_cols[row]), row
        np.testing.assert_array_equal(np.sort(values[row]), np.sort(want_values[row]))
        np.testing.assert_array_equal(values[row], scores[row, cols[row]])
    # Rows wider than 2^16 columns count with two sums.
    wide = rng.standard_normal((2, 70000)).astype(np.float32)
    _, cols = threshold_topk(jnp.asarray(wide), 64)
    _, want = jax.lax.top_k(jnp.asarray(wide), 64)
    assert all(set(a) == set(b) for a, b in zip(np.asarray(cols), np.asarray(want)))


@pytest.mark.parametrize("candidate_tokens", [64, 4224])
def test_fast_ranking_equals_flat(candidate_tokens):
    # Candidates covering every token (4224: rows wider than 4096 columns).
    T, L, top_k = 6, 4200 if candidate_tokens > 64 else 60, 16
    q, w, k = random_indexer_inputs(12, T, L)
    got = indexer.hierarchical_topk(q, w, k, top_k, HierarchicalConfig(
        block_size=64 if candidate_tokens > 64 else 4, candidate_tokens=candidate_tokens,
        query_tile=2, fine_batch_size=6, fast_ranking=True), q_offset=L - T)
    assert_equals_flat_topk(got, q, w, k, top_k, L - T, best_first=False)


def test_sink_and_local_blocks_are_always_selected():
    B, nb = 4, 10
    pos = np.array([39, 37, 20, 3, 4, -1], np.int32)
    scores = np.tile(np.arange(nb, dtype=np.float32)[::-1], (len(pos), 1))  # block 0 best
    scores[:, 0] = -1e9  # the sink block scores worst, and so do the local blocks
    for t, p in enumerate(pos):
        scores[t, p // B] = -1e9
        scores[t, (np.arange(nb) * B) > p] = -np.inf
    got = np.asarray(indexer.select_candidate_blocks(
        jnp.asarray(scores), jnp.asarray(pos), 4, block_size=B, sink_blocks=1, local_blocks=2))
    for t, p in enumerate(pos[:-1]):
        want = {0, p // B, max(p // B - 1, 0)}
        assert want <= set(got[t].tolist()), (t, got[t])
        assert (got[t][got[t] >= 0] <= p // B).all(), "a block in the query's future"
    assert (got[-1] == -1).all(), "a padding row selects nothing"
    forced = np.asarray(forced_blocks(jnp.asarray(pos), nb, block_size=B, sink_blocks=1,
                                      local_blocks=2))
    assert forced[0].nonzero()[0].tolist() == [0, 8, 9]
    # The tile union keeps every query's forced blocks even when it is cut to 4 blocks.
    table = np.asarray(tile_candidate_union(jnp.asarray(got[:4]), 2, 4, n_blocks=nb))
    assert {0, 8, 9} <= set(table[0].tolist()) and {0, 4, 5} <= set(table[1].tolist())
    slots = np.asarray(table_slots(jnp.asarray(table), jnp.asarray(got[:4]), 2, nb))
    found = np.where(slots >= 0, np.take_along_axis(table[[0, 0, 1, 1]], np.maximum(slots, 0),
                                                    axis=1), -1)
    assert np.array_equal(found[slots >= 0], got[:4][slots >= 0])


def test_minus_one_padding_when_fewer_than_top_k_tokens_are_visible():
    T, top_k = 10, 6
    q, w, k = random_indexer_inputs(3, T, T)
    got = np.asarray(indexer.hierarchical_topk(q, w, k, top_k, cfg(block_size=4)))
    for t in range(T):
        assert (got[t, :min(top_k, t + 1)] >= 0).all() and (got[t, t + 1:] == -1).all()
    assert_equals_flat_topk(got, q, w, k, top_k)


def test_recall_on_a_hand_made_example():
    # 5 blocks of 4 tokens, one query at position 19 (sees all), scores = keys (d=1, w=1).
    # Forced: the sink block 0 and the local block 4. Block 1 holds the best token (10) but
    # the worst mean; block 2 has the best mean.
    q = np.ones((1, 1, 1), np.float32)
    w = np.ones((1, 1), np.float32)
    k = np.array([0, 0, 0, 0, 10, -1, -1, -1, 3.0, 3.1, 3.2, 3.3, 2, 2, 2, 2, 1, 1, 1, 1],
                 np.float32)[:, None]
    flat = np.asarray(indexer.flat_topk(q, w, k, 4, q_offset=19))
    assert flat[0].tolist() == [4, 11, 10, 9]
    # Budget 3 blocks: forced + block 2 -> {11, 10, 9, 8}: recall 3/4.
    config = HierarchicalConfig(block_size=4, candidate_tokens=12, bound_blocks=0)
    got = np.asarray(indexer.hierarchical_topk(q, w, k, 4, config, q_offset=19))
    assert sorted(got[0].tolist()) == [8, 9, 10, 11]  # fast ranking: a set
    assert indexer.recall(got, flat) == pytest.approx(3 / 4)
    assert indexer.iou(got, flat) == pytest.approx(3 / 5)
    # Budget 4 blocks: by mean the 4th is block 3 (recall still 3/4); by upper bound
    # (one bound slot) it is block 1 (bound 10): recall 1.
    more = np.asarray(indexer.hierarchical_topk(q, w, k, 4, config.replace(candidate_tokens=16),
                                                q_offset=19))
    assert indexer.recall(more, flat) == pytest.approx(3 / 4)
    bound = np.asarray(indexer.hierarchical_topk(
        q, w, k, 4, config.replace(candidate_tokens=16, bound_blocks=1), q_offset=19))
    assert sorted(bound[0].tolist()) == [4, 9, 10, 11]


def test_block_recall_ceiling_on_a_hand_made_example():
    # Blocks of 4. Row 0: reference tokens in blocks 0 (x2), 2 (x1), 5 (x1); row 1: one
    # token and -1 padding.
    ref = np.array([[0, 3, 9, 21], [6, -1, -1, -1]])
    assert indexer.block_recall_ceiling(ref, 1, 4) == pytest.approx((2 / 4 + 1) / 2)
    assert indexer.block_recall_ceiling(ref, 2, 4) == pytest.approx((3 / 4 + 1) / 2)
    assert indexer.block_recall_ceiling(ref, 3, 4) == pytest.approx(1.0)


def test_topk_block_fraction_on_a_hand_made_example():
    # Blocks of 4. Query at position 21 (6 visible blocks) holds tokens in blocks 0, 2, 5;
    # query at position 7 (2 visible blocks) one token in block 1.
    ref = np.array([[0, 3, 9, 21], [6, -1, -1, -1]])
    assert indexer.topk_block_fraction(ref, 4, [21, 7]) == pytest.approx((3 + 1) / (6 + 2))


@pytest.mark.parametrize("seed", [0, 1])
def test_no_selector_beats_the_block_recall_ceiling(seed):
    T, L, top_k, B = 24, 300, 16, 8
    q, w, k = random_indexer_inputs(100 + seed, T, L)
    q_offset = L - T
    flat = np.asarray(indexer.flat_topk(q, w, k, top_k, q_offset=q_offset))
    for blocks in (2, 4, 8):
        config = HierarchicalConfig(block_size=B, candidate_tokens=blocks * B, query_tile=1,
                                    fine_batch_size=8, bound_blocks=1)
        got = np.asarray(indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=q_offset))
        assert indexer.recall(got, flat) <= indexer.block_recall_ceiling(flat, blocks, B) + 1e-9
    # With every block allowed the ceiling is 1.
    assert indexer.block_recall_ceiling(flat, -(-L // B), B) == 1.0


def test_coarse_scores_match_brute_force_on_block_means():
    T, L, B = 6, 50, 8
    q, w, k = random_indexer_inputs(2, T, L, H=3)
    summaries = block_summaries(jnp.asarray(k), B)
    nb = -(-L // B)
    means = np.stack([k[b * B:(b + 1) * B].mean(0) for b in range(nb)])
    got = np.asarray(indexer.coarse_block_scores(q, w, summaries, block_size=B, q_offset=20))
    want = brute_force_scores(q, w, means, nb)  # no token mask; block-causal below
    visible = (np.arange(nb)[None, :] * B) <= (20 + np.arange(T))[:, None]
    np.testing.assert_array_equal(np.isfinite(got), visible)
    np.testing.assert_allclose(got[visible], want[visible], rtol=1e-4, atol=1e-4)
    # Lighter coarse scorer: the 2 heads with the largest |w| of each query.
    light = np.asarray(indexer.coarse_block_scores(q, w, summaries, block_size=B, q_offset=20,
                                                   coarse_heads=2))
    for t in range(T):
        heads = np.argsort(-np.abs(w[t]))[:2]
        row = brute_force_scores(q[t:t + 1, heads], w[t:t + 1, heads], means, nb)[0]
        np.testing.assert_allclose(light[t][visible[t]], row[visible[t]], rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a heavy equivalence: default-tier headroom
@pytest.mark.parametrize("seed", [0, 1])
def test_block_upper_bounds_bound_every_visible_token(seed):
    T, L, B = 9, 77, 8
    q, w, k = (a.copy() for a in random_indexer_inputs(seed, T, L, H=3))
    w[:, 0] = -np.abs(w[:, 0])  # at least one negative head weight everywhere
    k[:16] *= 0.05  # two tight blocks (the radius bound matters there)
    q_offset = 60
    pos = jnp.asarray(q_offset + np.arange(T), jnp.int32)
    bounds = np.asarray(block_upper_bounds(q, w, block_summaries(jnp.asarray(k), B),
                                           block_size=B, q_positions=pos))
    scores = brute_force_scores(q, w, k, q_offset)
    for b in range(-(-L // B)):
        best = scores[:, b * B:(b + 1) * B].max(axis=1)
        seen = np.isfinite(best)
        assert (bounds[seen, b] >= best[seen] - 1e-4).all(), b
        assert np.array_equal(np.isfinite(bounds[:, b]), b * B <= q_offset + np.arange(T))


@pytest.mark.parametrize("field,value,message", [
    ("block_size", 0, r"block_size must be an int in \[1, 65536\]"),
    ("candidate_tokens", -5, "candidate_tokens must be None or an int"),
    ("coarse_keep_ratio", 1.5, r"coarse_keep_ratio must be None or a number in \(0, 1\]"),
    ("fine_batch_size", 0, "fine_batch_size must be an int"),
    ("sink_blocks", -1, "sink_blocks must be an int"),
    ("local_blocks", 0, r"local_blocks must be an int in \[1, "),
    ("coarse_heads", 0, "coarse_heads must be None or an int"),
    ("coarse_head_select", "random", "coarse_head_select must be one of"),
    ("query_tile", 3, r"fine_batch_size \(128\) must be a multiple of query_tile \(3\)"),
    ("exact", 1, "exact must be a bool"),
    ("refine_blocks", 0, "refine_blocks must be an int"),
])
def test_bad_configs_are_rejected_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        HierarchicalConfig(**{field: value})


def test_budget_rules_and_call_time_checks():
    with pytest.raises(ValueError, match="exactly one of candidate_tokens and coarse_keep_ratio"):
        HierarchicalConfig(coarse_keep_ratio=0.8)
    ratio = HierarchicalConfig(candidate_tokens=None, coarse_keep_ratio=0.8)
    assert ratio.candidate_blocks(10) == 8
    with pytest.raises(ValueError, match="unknown HierarchicalConfig fields"):
        HierarchicalConfig.from_dict({"blok_size": 3})
    q, w, k = random_indexer_inputs(0, 4, 32)
    with pytest.raises(ValueError, match=r"candidate_tokens \(16\) must be >= top_k \(20\)"):
        indexer.hierarchical_topk(q, w, k, 20, cfg())
    with pytest.raises(ValueError, match=r"coarse_heads \(9\) must be in \[1, index heads = 4\]"):
        indexer.hierarchical_topk(q, w, k, 4, cfg(coarse_heads=9))


def test_a_budget_by_length_runs_the_budget_of_its_length():
    rule = ((64, 32), (128, 48), (512, 96))
    by_length = HierarchicalConfig(candidate_tokens=None, block_size=16, length_budgets=rule)
    assert [by_length.budget_tokens(n) for n in (1, 64, 65, 128, 200, 512, 4096)] == [
        32, 32, 48, 48, 96, 96, 96]
    assert by_length.min_budget_tokens() == 32 and by_length.candidate_blocks(8) == 3
    stored = json.loads(json.dumps(by_length.to_dict()))  # pairs come back as lists
    assert HierarchicalConfig.from_dict(stored) == by_length
    q, w, k = random_indexer_inputs(3, 40, 200)
    for L, tokens in ((128, 48), (200, 96)):
        got = indexer.hierarchical_topk(q, w, k[:L], 8, by_length, q_offset=L - 40)
        fixed = by_length.replace(length_budgets=None, candidate_tokens=tokens)
        want = indexer.hierarchical_topk(q, w, k[:L], 8, fixed, q_offset=L - 40)
        np.testing.assert_array_equal(np.sort(np.asarray(got), 1), np.sort(np.asarray(want), 1))
    with pytest.raises(ValueError, match="exactly one of candidate_tokens and coarse_keep_ratio"
                                         r".*length_budgets=\(\(64, 32\),\)"):
        HierarchicalConfig(length_budgets=((64, 32),))
    with pytest.raises(ValueError, match="length_budgets must be None or"):
        HierarchicalConfig(candidate_tokens=None, length_budgets=((128, 32), (64, 16)))
    with pytest.raises(ValueError, match=r"length_budgets at 64 keys \(32\) must be >= top_k"):
        indexer.hierarchical_topk(q, w, k[:64], 40, by_length, q_offset=24)


# exact: default-tier time budget, in the slow tier
@pytest.mark.parametrize("exact", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_pallas_kernels_slot_in(exact):
    """Coarse and fine scores through the dispatch's Pallas kernels (interpreted on CPU)
    select the same tokens as the XLA references."""
    T, L, top_k = 16, 64, 8
    q, w, k = random_indexer_inputs(21, T, L)
    config = cfg(query_tile=4, bound_blocks=1, exact=exact)
    want = indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=L - T, backend="xla")
    got = indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=L - T,
                                    backend="interpret")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("T,exact", [(256, False), (1, False), (64, True)])
def test_lowers_for_cuda_with_the_triton_kernels(T, exact):
    """The whole hierarchical selection (prefill chunk, decode, exact mode) lowers for CUDA
    from this CPU machine, its coarse and fine stages as Triton kernels."""
    from tests.pallas_kernels.test_kernels_common import TRITON_MARKER, lower_for_cuda

    S = jax.ShapeDtypeStruct
    L, H, d = 4096, 4, 64
    config = HierarchicalConfig(exact=exact)
    structs = (S((T, H, d), jnp.bfloat16), S((T, H), jnp.float32), S((L, d), jnp.bfloat16),
               S((), jnp.int32))
    text = lower_for_cuda(
        lambda q, w, k, off: indexer.hierarchical_topk(q, w, k, 256, config, q_offset=off,
                                                       backend="pallas"),
        *structs, device_kind="NVIDIA H100 80GB HBM3")
    assert text.count(TRITON_MARKER) >= 2
