"""experiments.training.steps: the KL target captured from the model's pass, the stage losses,
one optimisation step per stage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.training import steps as ts
from indexer import index_scores
from model import Transformer, get_config
from model.layer_stack import layer_plan
from model.transformer import with_config


@pytest.fixture(scope="module")
def tiny():
    return Transformer(get_config("tiny", attention="dense", rope_theta=300.0),
                       rngs=nnx.Rngs(0))


def _batch(seed, B=2, T=48):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 256, (B, T + 1)), jnp.int32)


def _captured(model, tokens):
    _, captured = jax.jit(lambda t: model.forward(t, capture=ts.KL_CAPTURE))(tokens)
    return captured


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_kl_target_is_a_causal_distribution(tiny):
    p = np.stack(_captured(tiny, _batch(1)[0, :-1])["attention_target"])
    assert p.shape == (tiny.config.n_layers, 48, 48)
    assert np.all(p >= 0)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    future = np.triu(np.ones((48, 48), bool), k=1)
    assert np.all(p[:, future] == 0)
    assert np.all(p[:, 0, 0] == pytest.approx(1.0))  # query 0 sees only itself


def test_kl_target_is_the_head_summed_softmax_of_the_layers_own_projections(tiny):
    tokens = _batch(7)[0, :-1]
    T = tokens.shape[0]
    layer = tiny.layer(0)
    x = tiny.embed(tokens)  # the input of layer 0
    q, rows, _ = layer.attn.project(layer.attn_norm(x), jnp.arange(T))
    q, k = np.asarray(q, np.float64), np.asarray(rows["k"], np.float64)
    H, D = q.shape[1:]
    group = H // k.shape[1]
    future = np.triu(np.ones((T, T), bool), k=1)
    p = np.zeros((T, T))
    for head in range(H):
        logits = q[:, head] @ k[:, head // group].T / np.sqrt(D)
        logits[future] = -np.inf
        e = np.exp(logits - logits.max(-1, keepdims=True))
        p += e / e.sum(-1, keepdims=True)
    p /= p.sum(-1, keepdims=True)
    captured = np.asarray(_captured(tiny, tokens)["attention_target"][0])
    np.testing.assert_allclose(captured, p, rtol=1e-4, atol=1e-6)


def test_indexer_kl_is_the_kl_divergence_nonnegative_and_zero_for_its_own_distribution(tiny):
    captured = _captured(tiny, _batch(2)[0, :-1])
    q, w, k = captured["indexer"][0]
    p = captured["attention_target"][0]
    scores = np.asarray(index_scores(q, w, k, backend="xla"), np.float64)
    log_q = scores - scores.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    p64 = np.asarray(p, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p64 > 0, p64 * (np.log(p64) - log_q), 0.0)
    kl = float(ts.indexer_kl(q, w, k, p))
    assert kl == pytest.approx(terms.sum(-1).mean(), rel=1e-4)
    assert kl > 0
    own = jax.nn.softmax(jnp.asarray(scores, jnp.float32), axis=-1)
    assert abs(float(ts.indexer_kl(q, w, k, own))) < 1e-5


def test_kl_loss_trains_the_indexer_only_and_needs_dense_attention(tiny):
    graphdef, main, idx, rest = ts.split_model(tiny)
    batch = _batch(8)
    grads = jax.jit(jax.grad(
        lambda m, i: ts.indexer_kl_loss(nnx.merge(graphdef, m, i, rest), batch),
        argnums=(0, 1)))(main, idx)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads[0]))
    assert all(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(grads[1]))
    sparse = with_config(tiny, tiny.config.replace(attention="sparse"))
    with pytest.raises(ValueError, match="attention='dense'"):
        ts.indexer_kl_loss(sparse, batch)


# dense_long trains what dense does, on longer windows: the slow tier (default-tier budget).
@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow)
                                   if s == "dense_long" else s for s in ts.STAGES])
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

    grads = jax.jit(jax.grad(loss))(idx)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lr = [float(ts.lr_schedule(s, 100, peak=1.0, warmup=10, final_frac=0.1))
          for s in range(101)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert lr[100] == pytest.approx(0.1)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
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


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
@pytest.mark.parametrize("stage", ["dense", "indexer_warmup"])
def test_remat_gives_the_same_loss_and_gradients(tiny, stage):
    graphdef, main, idx, rest = ts.split_model(tiny)
    trainable, frozen = ts.trainable_of(stage, main, idx)
    batch = _batch(6, B=2, T=40)

    def loss_and_grads(remat):
        loss_fn = ts.stage_loss(stage, remat=remat)
        return jax.value_and_grad(
            lambda t: loss_fn(ts.merge_stage(graphdef, stage, t, frozen, rest), batch))

    # tiny's two layers are one segment, scanned: one unit body (model.layer_stack)
    (segment,) = layer_plan(tiny.config).segments
    assert (segment.period, segment.repeats) == (1, tiny.config.n_layers)
    vals = []
    for remat in (False, True):
        f = loss_and_grads(remat)
        # remat=True rematerialises the scanned unit (the "remat" primitive, traced once in
        # the scan's body), and only then; the warm-up's per-layer KL terms are always
        # checkpointed (steps.indexer_kl).
        kl_terms = tiny.config.n_layers if stage == "indexer_warmup" else 0
        assert str(jax.make_jaxpr(f)(trainable)).count("remat") == (
            (1 if remat else 0) + kl_terms)
        loss, grads = jax.jit(f)(trainable)
        vals.append((float(loss), _leaves(grads)))
    assert vals[0][0] == pytest.approx(vals[1][0], rel=1e-6)
    assert any(np.abs(g).max() > 0 for g in vals[0][1])
    for a, b in zip(vals[0][1], vals[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
