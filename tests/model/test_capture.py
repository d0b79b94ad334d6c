"""What a pass captures (model.CAPTURE_KINDS) and the runner's all-position logits, captures
and generation from an existing cache: all taken from the model's one forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from indexer import flat_topk
from model import ModelRunner, Transformer, get_config
from model.cache import layer_of

TOL = dict(rtol=2e-4, atol=2e-4)


def _model(seed=0, **overrides):
    return Transformer(get_config("tiny", **overrides), rngs=nnx.Rngs(seed))


def _tokens(seed, n):
    return np.asarray(jax.random.randint(jax.random.key(seed), (n,), 0, 256), np.int32)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
@pytest.mark.parametrize("attention, kinds", [("dense", ("indexer", "attention_target")),
                                              ("sparse", ("indexer", "indices"))])
def test_capture_leaves_the_logits_unchanged(attention, kinds):
    model = _model(0, attention=attention)
    toks = jnp.asarray(_tokens(1, 72))
    plain = model.forward(toks)
    logits, captured = model.forward(toks, capture=kinds)
    np.testing.assert_array_equal(plain, logits)
    assert sorted(captured) == sorted(kinds)
    assert all(len(v) == model.config.n_layers for v in captured.values())


@pytest.mark.slow  # a heavy equivalence: default-tier headroom
def test_attention_target_is_a_causal_distribution_over_keys():
    model = _model(1, attention="dense")
    _, captured = model.forward(jnp.asarray(_tokens(2, 40)), capture=("attention_target",))
    for p in map(np.asarray, captured["attention_target"]):
        assert p.shape == (40, 40) and np.all(p >= 0)
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
        assert np.all(p[np.triu_indices(40, k=1)] == 0)
        assert p[0, 0] == pytest.approx(1.0)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_captured_indices_are_the_flat_top_k_of_the_captured_indexer_outputs():
    model = _model(2)  # sparse, flat
    _, captured = model.forward(jnp.asarray(_tokens(3, 80)), capture=("indexer", "indices"))
    for (q, w, k), got in zip(captured["indexer"], captured["indices"]):
        want = flat_topk(q, w, k, model.config.top_k)
        np.testing.assert_array_equal(got, want)
        assert np.asarray(got)[0, 1] == -1 and np.asarray(got)[-1].min() >= 0


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_indexer_input_and_target_rows_are_what_a_teacher_cache_keeps():
    """The captured indexer input reproduces the layer's captured indexer outputs through
    the layer's own indexer (a shared layer: its full layer's input); the target at
    capture_rows is those rows of the full target."""
    model = _model(3, attention="dense", n_layers=3, indexer_types="FSF")
    toks = jnp.asarray(_tokens(4, 48))
    rows = jnp.asarray([0, 7, 30, 47])
    _, full = model.forward(toks, capture=("attention_target",))
    logits, got = model.forward(toks, capture=("indexer", "indexer_input", "attention_target"),
                                capture_rows=rows)
    np.testing.assert_array_equal(logits, model.forward(toks))
    owner = [0, 0, 2]
    positions = jnp.arange(48)
    for i in range(3):
        np.testing.assert_allclose(got["attention_target"][i], full["attention_target"][i][rows],
                                   rtol=1e-5, atol=1e-6)
        src = got["indexer_input"][i]
        assert src.hidden.shape == (48, model.config.d_model) and src.query_hidden is None
        np.testing.assert_array_equal(src.hidden, got["indexer_input"][owner[i]].hidden)
        q, w, k = model.layer(owner[i]).indexer(src.hidden, positions)
        for a, b in zip((q, w, k), got["indexer"][i]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_capture_kinds_are_checked():
    with pytest.raises(ValueError, match=r"unknown kinds \['queries'\]"):
        _model(0).forward(jnp.asarray(_tokens(0, 8)), capture=("queries",))
    with pytest.raises(ValueError, match="'attention_target' needs attention='dense'"):
        _model(0).forward(jnp.asarray(_tokens(0, 8)), capture=("attention_target",))
    with pytest.raises(ValueError, match="'indices' needs attention='sparse'"):
        _model(0, attention="dense").forward(jnp.asarray(_tokens(0, 8)), capture=("indices",))


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_chunked_prefill_captures_equal_one_pass():
    model = _model(4, indexer="hierarchical")
    toks = _tokens(5, 150)
    full, captured_full = model.forward(jnp.asarray(toks), capture=("indexer", "indices"))
    logits, cache, captured = ModelRunner(model).prefill(
        toks, chunk=32, logits_from=0, capture=("indexer", "indices"), capture_from=70)
    np.testing.assert_allclose(logits, full, **TOL)
    assert logits.shape == (150, model.config.vocab_size)
    for i in range(model.config.n_layers):
        np.testing.assert_allclose(captured["indexer"].q[i], captured_full["indexer"][i].q[70:],
                                   **TOL)
        np.testing.assert_allclose(captured["indexer"].k[i],
                                   layer_of(cache, model.config, i).k_index[70:150], **TOL)
        np.testing.assert_array_equal(captured["indices"][i], captured_full["indices"][i][70:])


def test_capture_from_outside_the_prefill_is_rejected():
    runner = ModelRunner(_model(0))
    with pytest.raises(ValueError, match=r"capture_from must be in \[0, 19\]"):
        runner.prefill(_tokens(0, 20), capture=("indexer",), capture_from=20)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_generation_from_an_existing_cache_continues_the_prompt():
    runner = ModelRunner(_model(6))
    toks = _tokens(7, 90)
    want = list(runner.generate(toks, 6))
    _, cache = runner.prefill(toks[:64], capacity=96)
    got = list(runner.generate(toks[64:], 6, cache=cache, start=64))
    assert got == want


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_generate_rejects_bad_max_new_tokens(bad):
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        list(ModelRunner(_model(0)).generate(_tokens(0, 8), bad))


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_logits_from_returns_the_rows_from_that_position_on():
    runner = ModelRunner(_model(10))
    toks = _tokens(11, 130)
    every, _ = runner.prefill(toks, chunk=32, logits_from=0)
    tail, _ = runner.prefill(toks, chunk=32, logits_from=70)
    last, _ = runner.prefill(toks, chunk=32)
    assert every.shape == (130, 259) and tail.shape == (60, 259)
    np.testing.assert_allclose(tail, every[70:], **TOL)
    np.testing.assert_allclose(last, every[-1], **TOL)
    with pytest.raises(ValueError, match=r"logits_from must be None or in \[0, 129\]"):
        runner.prefill(toks, logits_from=130)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_compile_prefill_compiles_each_distinct_step_once():
    runner = ModelRunner(_model(12))
    # 200 tokens in chunks of 64 into a 256 cache: 3 full chunks (kv 256) + 1 of 8 -> 16 rows.
    assert runner.compile_prefill(200, chunk=64) == 2
    assert runner.compile_prefill(200, chunk=64, logits_from=150) == 3


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_window_selection_reads_the_last_top_k_tokens():
    """indexer="window": each query attends to itself and the top_k - 1 tokens before it
    (no indexer scoring) - sliding-window attention, the baseline the main job subtracts."""
    model = _model(13, indexer="window", top_k=8)
    toks = _tokens(14, 40)
    _, captured = model.forward(jnp.asarray(toks), capture=("indices",))
    got = np.asarray(captured["indices"][0])
    assert got[0].tolist() == [0] + [-1] * 7
    assert got[20].tolist() == list(range(20, 12, -1))
    # Same logits as dense attention when top_k covers the whole context.
    wide = _model(13, indexer="window", top_k=64).forward(jnp.asarray(toks))
    dense = _model(13, attention="dense").forward(jnp.asarray(toks))
    np.testing.assert_allclose(wide, dense, **TOL)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_dense_layers_attend_densely_inside_a_sparse_model():
    dense = _model(3, attention="dense")
    toks = jnp.asarray(_tokens(4, 90))  # > top_k: sparse layers do drop tokens here
    all_dense = ModelRunner(dense.__class__(dense.config.replace(
        attention="sparse", dense_layers=(0, 1)), rngs=nnx.Rngs(3))).prefill(toks, logits_from=0)
    np.testing.assert_allclose(all_dense[0], dense.forward(toks), **TOL)
    mixed = _model(3, attention="sparse", dense_layers=(0,))
    _, captured = mixed.forward(toks, capture=("indices",))
    assert np.all(np.asarray(captured["indices"][0]) == -1)  # layer 0 read everything
    assert np.all(np.asarray(captured["indices"][1])[-1] >= 0)  # layer 1 selected top_k
    sparse = _model(3, attention="sparse").forward(toks)
    assert not np.allclose(mixed.forward(toks), sparse, **TOL)
    with pytest.raises(ValueError, match="dense_layers must be distinct layer indices"):
        get_config("tiny", dense_layers=(2,))
