"""MLA, DeepSeekMoE and YaRN pieces against plain-numpy references of their formulas (the
whole families against transformers: tests/model/test_dsa_families.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from indexer.config import YarnConfig
from model.architecture import MoEConfig
from model.moe import expert_mix, route


def _route_reference(x, weight, bias, moe):
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ weight.astype(np.float64).T)))
    choice = scores + bias
    E, G = moe.n_routed_experts, moe.n_group
    out_w, out_e = [], []
    for t in range(len(x)):
        groups = choice[t].reshape(G, E // G)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1) if G > 1 else np.zeros(1)
        kept = np.argsort(-group_score)[:moe.topk_group]
        masked = np.full(E, -np.inf)
        for g in kept:
            masked[g * (E // G):(g + 1) * (E // G)] = choice[t, g * (E // G):(g + 1) * (E // G)]
        experts = np.argsort(-masked)[:moe.num_experts_per_tok]
        w = scores[t, experts]
        w = w / (w.sum() + 1e-20) if moe.norm_topk_prob else w
        out_w.append(w * moe.routed_scaling_factor)
        out_e.append(experts)
    return np.asarray(out_w), np.asarray(out_e)


def test_router_is_group_limited_and_weights_ignore_the_bias():
    moe = MoEConfig(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=8,
                    n_group=4, topk_group=2, routed_scaling_factor=2.5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 12)).astype(np.float32)
    weight = rng.normal(size=(16, 12)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=16).astype(np.float32)
    w, e = route(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(bias), moe)
    want_w, want_e = _route_reference(x, weight, bias, moe)
    np.testing.assert_array_equal(np.sort(np.asarray(e), 1), np.sort(want_e, 1))
    order = np.argsort(np.asarray(e), 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(want_w, np.argsort(want_e, 1), 1), rtol=1e-5)
    # Every chosen expert lies in one of the 2 kept groups of 4 experts.
    assert all(len(set((row // 4).tolist())) <= 2 for row in np.asarray(e))


@pytest.mark.parametrize("T", [1, 37])  # 1 x 3 <= 8: gathered weights; 37 x 3: ragged_dot
def test_only_the_chosen_experts_equal_every_expert_weighted(T):
    E, D, F, k = 8, 12, 6, 3
    rng = np.random.default_rng(T)
    x = rng.normal(size=(T, D)).astype(np.float32)
    gate, up = (rng.normal(size=(E, D, F)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(E, F, D)).astype(np.float32)
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(size=(T, k)).astype(np.float32)
    got = expert_mix(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
                     (jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down)))
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    want = np.zeros((T, D))
    for t in range(T):
        for j in range(k):
            e = experts[t, j]
            want[t] += weights[t, j] * ((silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
    # Batched decode vmaps the feed-forward over serving's slots.
    params = [jnp.asarray(a) for a in (gate, up, down)]
    vmapped = jax.vmap(lambda xs, ws, es: expert_mix(xs, ws, es, tuple(params)))(
        jnp.asarray(x)[:, None], jnp.asarray(weights)[:, None], jnp.asarray(experts)[:, None])
    np.testing.assert_allclose(np.asarray(vmapped)[:, 0], want, rtol=2e-4, atol=2e-4)


def test_yarn_frequencies_and_scales():
    # transformers 5.23's _compute_yarn_parameters for the fixtures (recorded there):
    # rotary dim 8, theta 1e4, original length 32, beta 32 / 1.
    v32 = YarnConfig(factor=4.0, original_max_position_embeddings=32, mscale=1.0,
                     mscale_all_dim=1.0)
    glm = YarnConfig(factor=2.0, original_max_position_embeddings=32, mscale=1.0,
                     mscale_all_dim=1.0)
    np.testing.assert_allclose(v32.inverse_frequencies(8, 10000.0), [1, 0.025, 0.0025, 0.00025],
                               rtol=1e-6)
    np.testing.assert_allclose(glm.inverse_frequencies(8, 10000.0), [1, 0.05, 0.005, 0.0005],
                               rtol=1e-6)
    assert v32.cos_sin_factor() == 1.0  # mscale / mscale_all_dim
    # MLA's softmax scale: qk_head_dim^-0.5 x (0.1 ln 4 + 1)^2 (0.2646423 for qk 24).
    assert 24 ** -0.5 * v32.softmax_scale_factor() == pytest.approx(0.2646423, rel=1e-6)
    assert YarnConfig(factor=4.0, mscale=1.0).softmax_scale_factor() == 1.0
    assert YarnConfig(factor=4.0).cos_sin_factor() == pytest.approx(0.1 * np.log(4) + 1)
    with pytest.raises(ValueError, match="YarnConfig.factor must be a positive number"):
        YarnConfig(factor=0)


@pytest.mark.parametrize("T", [1, 37])
def test_fp8_experts_dequantize_where_used_and_foreign_ids_are_skipped(T):
    """Experts kept as e4m3 + block scales (the checkpoint's [out, in] blocks, transposed
    as dosa stores them) mix like their dequantized weights; an id >= E (an expert another
    device holds, weight 0) adds nothing."""
    from model.moe import MoE, fp8_scale_block
    from model.pretrained.fp8 import dequantize as dequantize_np
    from model.pretrained.fp8 import quantize

    E, D, F, k, block = 8, 40, 24, 3, (16, 8)  # blocks that do not divide D or F
    rng = np.random.default_rng(T)
    x = rng.normal(size=(T, D)).astype(np.float32)
    dense, stored, scales = [], [], []
    for shape in ((E, D, F), (E, D, F), (E, F, D)):
        w = rng.normal(size=shape).astype(np.float32)
        pairs = [quantize(w[e].T, block) for e in range(E)]  # checkpoint layout [out, in]
        dense.append(np.stack([dequantize_np(q, s, block).T for q, s in pairs]))
        stored.append(np.stack([q.T for q, _ in pairs]))
        scales.append(np.stack([s.T for _, s in pairs]))
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(size=(T, k)).astype(np.float32)
    got = expert_mix(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
                     tuple(jnp.asarray(a) for a in stored + scales), fp8_scale_block(block))
    want = expert_mix(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
                      tuple(jnp.asarray(a) for a in dense))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # The first choice of every token lives elsewhere: weight 0, id E.
    foreign = experts.copy()
    foreign[:, 0] = E
    kept = weights.copy()
    kept[:, 0] = 0.0
    got = expert_mix(jnp.asarray(x), jnp.asarray(kept), jnp.asarray(foreign),
                     tuple(jnp.asarray(a) for a in dense))
    want = expert_mix(jnp.asarray(x), jnp.asarray(weights[:, 1:]), jnp.asarray(experts[:, 1:]),
                      tuple(jnp.asarray(a) for a in dense))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # The module keeps e4m3 and its scale grids.
    module = nnx.eval_shape(lambda: MoE(D, MoEConfig(n_routed_experts=E, num_experts_per_tok=k,
                                                      moe_intermediate_size=F,
                                                      fp8_block=block), rngs=nnx.Rngs(0)))
    assert module.gate.get_value().dtype == jnp.float8_e4m3fn
    assert module.gate_scale.get_value().shape == (E, 5, 2)  # [D / block[1], F / block[0]]
    assert module.down_scale.get_value().shape == (E, 3, 3)
