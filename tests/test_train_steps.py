"""experiments.training_steps: KL target, stage losses, one optimisation step per stage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import training_steps as ts
from model import Transformer, get_config


@pytest.fixture(scope="module")
def tiny():
    return Transformer(get_config("tiny", attention="dense", rope_theta=300.0),
                       rngs=nnx.Rngs(0))


def _batch(seed, B=2, T=48):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 256, (B, T + 1)), jnp.int32)


def test_manual_dense_forward_matches_model(tiny):
    toks = _batch(0)[0, :-1]
    logits, hs, ps = ts.dense_forward_with_attention(tiny, toks)
    np.testing.assert_allclose(logits, tiny.forward(toks), rtol=1e-5, atol=1e-5)
    assert hs.shape == (2, 48, 64) and ps.shape == (2, 48, 48)


def test_kl_target_is_a_causal_distribution(tiny):
    _, p = ts.attention_target(tiny, _batch(1)[0, :-1])
    p = np.asarray(p)
    assert np.all(p >= 0)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    T = p.shape[-1]
    future = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(p[:, future] == 0)
    assert np.all(p[:, 0, 0] == pytest.approx(1.0))  # query 0 sees only itself


def test_indexer_kl_is_nonnegative_and_zero_for_its_own_distribution(tiny):
    layer = tiny.layers[0]
    hs, ps = ts.attention_target(tiny, _batch(2)[0, :-1])
    assert float(ts.indexer_kl(layer.indexer, hs[0], ps[0])) >= 0
    T = hs.shape[1]
    q, w, k = layer.indexer(hs[0], jnp.arange(T))
    from indexer import index_scores
    own = jax.nn.softmax(index_scores(q, w, k, backend="xla"), axis=-1)
    assert abs(float(ts.indexer_kl(layer.indexer, hs[0], own))) < 1e-5


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("stage", ts.STAGES)
def test_one_step_lowers_the_loss_and_trains_only_its_params(tiny, stage):
    graphdef, main, idx, rest = ts.split_model(tiny)
    trainable, frozen = ts.trainable_of(stage, main, idx)
    tx = ts.make_optimizer(weight_decay=0.0)
    step = ts.make_train_step(graphdef, stage, tx)
    evaluate = ts.make_eval_loss(graphdef, stage)
    batch = _batch(3)
    before = float(evaluate(trainable, frozen, rest, batch))
    frozen_before = _leaves(frozen)
    new, _, metrics = step(jax.tree.map(jnp.copy, trainable), tx.init(trainable), frozen, rest,
                           batch, 3e-3)
    assert float(metrics["loss"]) == pytest.approx(before, rel=1e-5)
    after = float(evaluate(new, frozen, rest, batch))
    assert after < before, (stage, before, after)
    for a, b in zip(frozen_before, _leaves(frozen)):
        np.testing.assert_array_equal(a, b)
    changed = [not np.array_equal(a, b) for a, b in zip(_leaves(trainable), _leaves(new))]
    assert all(changed)


def test_stage_one_gives_the_indexer_no_gradient(tiny):
    graphdef, main, idx, rest = ts.split_model(tiny)

    def loss(idx_params):
        return ts.lm_loss(nnx.merge(graphdef, main, idx_params, rest), _batch(4))

    grads = jax.grad(loss)(idx)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lr = [float(ts.lr_schedule(s, 100, peak=1.0, warmup=10, final_frac=0.1))
          for s in range(101)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert lr[100] == pytest.approx(0.1)


@pytest.mark.parametrize("stage", ts.STAGES)
def test_micro_batches_give_the_same_update(tiny, stage):
    graphdef, main, idx, rest = ts.split_model(tiny)
    trainable, frozen = ts.trainable_of(stage, main, idx)
    tx = ts.make_optimizer(weight_decay=0.1)
    batch = _batch(5, B=4, T=32)
    outs = []
    for micro in (1, 2):
        step = ts.make_train_step(graphdef, stage, tx, micro_batches=micro)
        new, _, metrics = step(jax.tree.map(jnp.copy, trainable), tx.init(trainable), frozen,
                               rest, batch, 1e-3)
        outs.append((_leaves(new), float(metrics["loss"])))
    assert outs[0][1] == pytest.approx(outs[1][1], rel=1e-5)
    for a, b in zip(outs[0][0], outs[1][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_remat_forward_gives_the_same_loss_and_gradients(tiny):
    graphdef, main, idx, rest = ts.split_model(tiny)
    batch = _batch(6, B=2, T=40)
    vals = []
    for fn in (ts.lm_loss, ts.lm_loss_remat):
        f = jax.jit(jax.value_and_grad(lambda m: fn(nnx.merge(graphdef, m, idx, rest), batch)))
        loss, grads = f(main)
        vals.append((float(loss), _leaves(grads)))
    assert vals[0][0] == pytest.approx(vals[1][0], rel=1e-6)
    for a, b in zip(vals[0][1], vals[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
