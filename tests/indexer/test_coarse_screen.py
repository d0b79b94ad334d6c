"""The learned coarse screen and the adaptive (mass) budget of the hierarchical indexer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import indexer
from indexer import HierarchicalConfig, ScreenParams
from indexer.block_summaries import block_summaries
from indexer.candidates import forced_blocks, select_candidate_blocks
from indexer.coarse_screen import (
    mass_budget,
    mean_scales,
    screen_block_scores,
    screen_loss,
    topk_block_shares,
    untrained_screen,
)
from indexer.hierarchical import coarse_block_scores, fine_topk


def _inputs(seed, T, L, H=4, d=16):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (T, H, d))
    w = jax.random.normal(ks[1], (T, H))
    k = jax.random.normal(ks[2], (L, d))
    return q, w, k


def test_untrained_screen_scores_are_the_mean_screens():
    q, w, k = _inputs(0, 37, 203)
    s = block_summaries(k, 16)
    learned = screen_block_scores(q, w, mean_scales(4, 16), s, block_size=16,
                                  q_offset=203 - 37)
    mean = coarse_block_scores(q, w, s, block_size=16, q_offset=203 - 37)
    np.testing.assert_allclose(learned, mean, rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(learned)[0, -1]) or 203 - 37 >= 192  # causal blocks masked


@pytest.mark.slow  # default-tier time budget (a gradient compile); runs in CI's slow tier
def test_a_training_step_lowers_the_screen_loss_on_a_tiny_batch():
    q, w, k = _inputs(1, 48, 300)
    s = block_summaries(k, 16)
    flat = indexer.flat_topk(q, w, k, 32, q_offset=300 - 48)
    target = topk_block_shares(flat, s.count.shape[0], 16)
    np.testing.assert_allclose(np.sum(target, axis=1), 1.0, rtol=1e-6)
    params = (mean_scales(4, 16), jnp.zeros(()))

    def loss(p):
        return screen_loss(p[0], p[1], q, w, s, target, block_size=16, q_offset=300 - 48)

    opt = optax.adam(0.02)
    state = opt.init(params)
    first = float(loss(params))
    grad = jax.jit(jax.grad(loss))
    for _ in range(30):
        grads = grad(params)
        assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert float(loss(params)) < first - 0.05


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_an_oracle_screen_reaches_the_block_recall_ceiling():
    # Ranking blocks by how many flat top-k tokens they hold, then scoring exactly inside
    # them, recovers exactly the best share any choice of that many blocks can hold.
    T, L, B, top_k, n = 40, 333, 16, 24, 5
    q, w, k = _inputs(2, T, L)
    flat = np.asarray(indexer.flat_topk(q, w, k, top_k, q_offset=L - T))
    nb = -(-L // B)
    counts = topk_block_shares(flat, nb, B)
    pos = L - T + jnp.arange(T)
    visible = (jnp.arange(nb)[None, :] * B) <= pos[:, None]
    oracle = jnp.where(visible, counts, -jnp.inf)
    cands = select_candidate_blocks(oracle, pos, n, block_size=B, sink_blocks=0,
                                    local_blocks=0)
    _, tokens = fine_topk(q, w, k, cands, top_k, block_size=B, q_offset=L - T)
    assert indexer.recall(np.asarray(tokens), flat) == pytest.approx(
        indexer.block_recall_ceiling(flat, n, B), abs=1e-6)


def _mass_reference(scores, temperature, threshold, forced):
    out = []
    for s, f in zip(np.asarray(scores, np.float64), np.asarray(forced)):
        s = np.where(f, -np.inf, s)
        finite = np.isfinite(s)
        if not finite.any():
            out.append(int(f.sum()))
            continue
        p = np.exp((s[finite] - s[finite].max()) / temperature)
        p = np.sort(p / p.sum())[::-1]
        need = int(np.searchsorted(np.cumsum(p), threshold - 1e-12) + 1)
        out.append(min(need, finite.sum()) + int(f.sum()))
    return np.asarray(out)


@pytest.mark.parametrize("threshold", [0.3, 0.8, 0.99, 1.0])
def test_the_mass_rule_keeps_exactly_the_fewest_blocks_reaching_the_threshold(threshold):
    rng = np.random.default_rng(3)
    T, nb = 50, 23
    scores = rng.normal(size=(T, nb)).astype(np.float32) * 3
    pos = rng.integers(0, nb * 8, size=T)
    seen = np.arange(nb)[None, :] * 8 <= pos[:, None]
    scores = np.where(seen, scores, -np.inf)
    forced = np.asarray(forced_blocks(jnp.asarray(pos), nb, block_size=8, sink_blocks=1,
                                      local_blocks=1))
    got = np.asarray(mass_budget(jnp.asarray(scores), 0.7, threshold, jnp.asarray(forced)))
    np.testing.assert_array_equal(got, _mass_reference(scores, 0.7, threshold, forced))
    assert np.all(got <= seen.sum(axis=1)) and np.all(got >= forced.sum(axis=1))


@pytest.mark.slow  # default-tier time budget (one compiled branch per bucket); CI's slow tier
@pytest.mark.parametrize("coarse", ["mean", "learned"])
def test_mass_rule_budgets_are_respected_and_follow_the_need(coarse):
    T, L, top_k = 64, 700, 16
    q, w, k = _inputs(4, T, L)
    screen = untrained_screen(4, 16)
    if coarse == "learned":  # non-trivial scales
        screen = screen._replace(scales=screen.scales + 0.05 * jax.random.normal(
            jax.random.key(9), screen.scales.shape))
    base = HierarchicalConfig(block_size=16, candidate_tokens=320, query_tile=8,
                              fine_batch_size=32, bound_blocks=2, coarse=coarse)
    fixed, fixed_stats = indexer.hierarchical_topk_with_stats(
        q, w, k, top_k, base, q_offset=L - T, screen=screen)
    assert float(fixed_stats["kept_blocks"]) == pytest.approx(20)  # 320 / 16
    results = {}
    for mass in (0.2, 1.0):
        cfg = base.replace(coarse_mass=mass, coarse_temperature=0.05)
        got, stats = indexer.hierarchical_topk_with_stats(q, w, k, top_k, cfg, q_offset=L - T,
                                                          screen=screen)
        kept, run = float(stats["kept_blocks"]), float(stats["run_blocks"])
        assert kept <= 20 and kept <= run <= 20  # a chunk runs at a bucket holding its need
        results[mass] = (np.asarray(got), kept, run)
    assert results[0.2][1] < results[1.0][1]
    assert results[0.2][2] < 20  # the small need ran at a smaller bucket
    # With every block needed, the mass rule is the fixed budget.
    np.testing.assert_array_equal(results[1.0][0], np.asarray(fixed))


def test_the_learned_coarse_needs_a_screen_and_configs_are_checked():
    q, w, k = _inputs(5, 8, 100)
    with pytest.raises(ValueError, match="coarse='learned' needs the layer's trained screen"):
        indexer.hierarchical_topk(q, w, k, 8, HierarchicalConfig(block_size=16,
                                                                candidate_tokens=32,
                                                                coarse="learned"))
    for field, value, message in [
            ("coarse", "max", r"coarse must be one of \('mean', 'learned'\)"),
            ("coarse_mass", 1.5, r"coarse_mass must be None or a number in \(0, 1\]"),
            ("coarse_temperature", 0, "coarse_temperature must be None or a number > 0"),
            ("mass_buckets", (0.5, 0.25, 1.0), "mass_buckets must be ascending")]:
        with pytest.raises(ValueError, match=message):
            HierarchicalConfig(**{field: value})
    with pytest.raises(ValueError, match="coarse_mass .* and exact"):
        HierarchicalConfig(coarse_mass=0.9, exact=True)


def test_screen_params_pytree():
    s = untrained_screen(2, 8)
    assert isinstance(s, ScreenParams) and s.scales.shape == (2, 3, 8)
    assert jax.tree.structure(s).num_leaves == 3
