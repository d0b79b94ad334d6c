import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import ModelRunner, Transformer, get_config, length_bucket
from model.sampling import sample_token, validate_sampling

TOL = dict(rtol=2e-4, atol=2e-4)


def _model(seed=0, **overrides):
    return Transformer(get_config("tiny", **overrides), rngs=nnx.Rngs(seed))


def _tokens(seed, n):
    return np.asarray(jax.random.randint(jax.random.key(seed), (n,), 0, 256), np.int32)


@pytest.fixture(scope="module")
def sparse_model():
    return _model(0)


def test_shapes_and_dtypes(sparse_model):
    logits = sparse_model.forward(jnp.asarray(_tokens(1, 40)))
    assert logits.shape == (40, 259) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


# dense: default-tier time budget, in the slow tier
@pytest.mark.parametrize("attention", [pytest.param("dense", marks=pytest.mark.slow), "sparse"])
def test_causality(attention):
    model = _model(1, attention=attention)
    toks = _tokens(2, 48)
    changed = toks.copy()
    changed[30:] = (changed[30:] + 7) % 256
    a = np.asarray(model.forward(jnp.asarray(toks)))
    b = np.asarray(model.forward(jnp.asarray(changed)))
    np.testing.assert_allclose(a[:30], b[:30], **TOL)
    assert not np.allclose(a[30:], b[30:], atol=1e-3)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_sparse_with_top_k_covering_context_equals_dense():
    dense = _model(2, attention="dense")
    sparse = _model(2, attention="sparse", top_k=64)
    toks = jnp.asarray(_tokens(3, 64))
    np.testing.assert_allclose(dense.forward(toks), sparse.forward(toks), **TOL)


@pytest.mark.slow  # a heavy equivalence: default-tier headroom
def test_sparse_with_small_top_k_differs_from_dense():
    toks = jnp.asarray(_tokens(4, 96))
    dense = _model(2, attention="dense").forward(toks)
    sparse = _model(2, attention="sparse", top_k=8).forward(toks)
    # Early positions see <= 8 tokens (identical); later ones drop tokens (different).
    np.testing.assert_allclose(dense[:8], sparse[:8], **TOL)
    assert not np.allclose(dense[-1], sparse[-1], atol=1e-3)


# dense: default-tier time budget, in the slow tier
@pytest.mark.parametrize("attention", [pytest.param("dense", marks=pytest.mark.slow), "sparse"])
def test_chunked_prefill_equals_one_shot(attention):
    runner = ModelRunner(_model(3, attention=attention))
    toks = _tokens(5, 150)  # not a multiple of any chunk
    one_shot, _ = runner.prefill(toks, chunk=256)
    chunked, _ = runner.prefill(toks, chunk=32)
    full = runner_forward_last(runner, toks)
    np.testing.assert_allclose(one_shot, chunked, **TOL)
    np.testing.assert_allclose(one_shot, full, **TOL)


def runner_forward_last(runner, toks):
    model = nnx.merge(runner.graphdef, runner.state)
    return np.asarray(model.forward(jnp.asarray(toks)))[-1]


# dense: default-tier time budget, in the slow tier
@pytest.mark.parametrize("attention", [pytest.param("dense", marks=pytest.mark.slow), "sparse"])
def test_prefill_then_decode_equals_prefill_of_concatenation(attention):
    runner = ModelRunner(_model(4, attention=attention))
    toks = _tokens(6, 70)
    logits, cache = runner.prefill(toks[:60], capacity=70)
    for i, t in enumerate(toks[60:]):
        logits, cache = runner.decode(int(t), cache, 60 + i)
    want, _ = runner.prefill(toks)
    np.testing.assert_allclose(logits, want, **TOL)


def test_prefill_from_a_reused_prefix_equals_full_prefill():
    runner = ModelRunner(_model(5))
    toks = _tokens(7, 90)
    _, cache = runner.prefill(toks[:40], capacity=90)
    logits, _ = runner.prefill(toks[40:], cache=cache, start=40)
    want, _ = runner.prefill(toks)
    np.testing.assert_allclose(logits, want, **TOL)


def test_length_bucket():
    assert length_bucket(1) == 256 and length_bucket(256) == 256 and length_bucket(257) == 512
    assert length_bucket(5, minimum=1) == 8


def test_context_overflow_is_rejected():
    runner = ModelRunner(_model(0, max_seq_len=128))
    with pytest.raises(ValueError, match="max_seq_len"):
        runner.prefill(_tokens(0, 200))


def test_generate_greedy_is_deterministic_and_seeded_sampling_reproducible(sparse_model):
    runner = ModelRunner(sparse_model)
    prompt = _tokens(8, 20)
    greedy = list(runner.generate(prompt, 6))
    assert greedy == list(runner.generate(prompt, 6))
    s1 = list(runner.generate(prompt, 6, temperature=1.0, top_p=0.9, seed=3))
    s2 = list(runner.generate(prompt, 6, temperature=1.0, top_p=0.9, seed=3))
    assert s1 == s2 and len(s1) == 6


def test_sampling_rules():
    logits = jnp.array([0.0, 3.0, 1.0, 2.9])
    keys = jax.random.split(jax.random.key(0), 200)
    assert int(sample_token(logits, keys[0], 0.0, 1.0)) == 1
    # top_p small: only the best token survives.
    assert {int(sample_token(logits, k, 1.0, 0.01)) for k in keys[:50]} == {1}
    # top_p = 1 at high temperature: every token shows up.
    assert {int(sample_token(logits, k, 5.0, 1.0)) for k in keys} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="top_p"):
        validate_sampling(1.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        validate_sampling(-1.0, 1.0)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_index_rope_scaling_moves_only_the_indexer_positions():
    """With index_rope_scaling s, the indexer's keys at position s * p equal those at p
    unscaled, the main attention is untouched, and None follows rope_scaling."""
    base = get_config("tiny", attention="dense")
    model = Transformer(base, rngs=nnx.Rngs(3))
    scaled = nnx.merge(nnx.split(Transformer(base.replace(index_rope_scaling=4.0),
                                             rngs=nnx.Rngs(3)))[0], nnx.split(model)[1])
    x = jax.random.normal(jax.random.key(0), (3, base.d_model))
    _, _, k_plain = model.layer(0).indexer(x, jnp.array([1, 2, 5]))
    _, _, k_scaled = scaled.layer(0).indexer(x, jnp.array([4, 8, 20]))
    np.testing.assert_allclose(k_scaled, k_plain, rtol=1e-5, atol=1e-5)
    assert not np.allclose(model.layer(0).indexer(x, jnp.array([4, 8, 20]))[2], k_plain)
    tokens = jnp.arange(24) % 200
    np.testing.assert_array_equal(model.forward(tokens), scaled.forward(tokens))
    assert base.replace(rope_scaling=2.0).indexer_rope_scaling == 2.0
    assert base.replace(rope_scaling=2.0, index_rope_scaling=8.0).indexer_rope_scaling == 8.0
