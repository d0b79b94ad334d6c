"""The model with indexer="hierarchical": decode from cached summaries, flat equivalence."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from indexer import HierarchicalConfig
from indexer.block_summaries import block_summaries
from model import ModelConfig, ModelRunner, Transformer, get_config
from model.cache import layer_of

TOL = dict(rtol=2e-4, atol=2e-4)


def _model(seed=0, **overrides):
    return Transformer(get_config("tiny", **overrides), rngs=nnx.Rngs(seed))


def _tokens(seed, n):
    return np.asarray(jax.random.randint(jax.random.key(seed), (n,), 0, 256), np.int32)


def test_tiny_hierarchical_budget_is_smaller_than_the_test_contexts():
    h = get_config("tiny").hierarchical
    assert h.candidate_tokens < 70 and h.query_tile > 1 and h.bound_blocks > 0


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
@pytest.mark.parametrize("exact", [False, True])
def test_prefill_then_decode_equals_prefill_of_concatenation(exact):
    config = get_config("tiny", indexer="hierarchical")
    runner = ModelRunner(Transformer(config.replace(hierarchical=config.hierarchical.replace(
        exact=exact)), rngs=nnx.Rngs(4)))
    toks = _tokens(6, 75)
    logits, cache = runner.prefill(toks[:60], capacity=75)
    for i, t in enumerate(toks[60:]):
        logits, cache = runner.decode(int(t), cache, 60 + i)
    want, full_cache = runner.prefill(toks)
    np.testing.assert_allclose(logits, want, **TOL)
    # The decode-updated summaries equal the prefill ones, and a recomputation.
    for layer in range(config.n_layers):
        got, ref = layer_of(cache, config, layer), layer_of(full_cache, config, layer)
        np.testing.assert_array_equal(got.summaries.count, ref.summaries.count)
        np.testing.assert_allclose(got.summaries.sum, ref.summaries.sum, rtol=1e-5, atol=1e-5)
        fresh = block_summaries(ref.k_index, 8, length=75)
        np.testing.assert_array_equal(ref.summaries.count, fresh.count)
        np.testing.assert_allclose(ref.summaries.max, fresh.max, rtol=1e-6)


@pytest.mark.slow  # 6 s (chunked prefill's equality: tests/model/test_model.py)
def test_chunked_prefill_equals_one_shot():
    runner = ModelRunner(_model(3, indexer="hierarchical"))
    toks = _tokens(5, 150)
    one_shot, _ = runner.prefill(toks, chunk=256)
    chunked, _ = runner.prefill(toks, chunk=32)
    np.testing.assert_allclose(one_shot, chunked, **TOL)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_a_budget_covering_everything_equals_the_flat_model():
    toks = jnp.asarray(_tokens(3, 96))
    flat = _model(2).forward(toks)
    everything = HierarchicalConfig(block_size=8, candidate_tokens=96, query_tile=4,
                                    fine_batch_size=32, fast_ranking=False)
    hier = _model(2, indexer="hierarchical", hierarchical=everything).forward(toks)
    np.testing.assert_allclose(flat, hier, **TOL)
    exact = _model(2, indexer="hierarchical",
                   hierarchical=get_config("tiny").hierarchical.replace(exact=True)).forward(toks)
    np.testing.assert_allclose(flat, exact, **TOL)
    # With the tiny budget (4 of 12 blocks) the selection really is sparser than flat.
    approx = _model(2, indexer="hierarchical").forward(toks)
    assert not np.allclose(flat[-1], approx[-1], atol=1e-3)


def test_config_round_trip_with_nested_hierarchical_config():
    config = get_config("tiny", indexer="hierarchical",
                        hierarchical={"block_size": 16, "candidate_tokens": 64, "exact": True})
    assert config.hierarchical == HierarchicalConfig(block_size=16, candidate_tokens=64,
                                                     exact=True)
    data = json.loads(config.to_json())
    assert data["hierarchical"]["block_size"] == 16
    assert ModelConfig.from_dict(data) == config
    with pytest.raises(ValueError, match="unknown HierarchicalConfig fields"):
        ModelConfig.from_dict({**data, "hierarchical": {"blocksize": 3}})
    with pytest.raises(ValueError, match=r"hierarchical.candidate_tokens must be >= top_k \(16\)"):
        get_config("tiny", indexer="hierarchical", hierarchical={"candidate_tokens": 8})
    with pytest.raises(ValueError, match="ModelConfig.hierarchical must be"):
        ModelConfig(hierarchical=3)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_flat_index_layers_keep_those_layers_flat():
    toks = jnp.asarray(_tokens(3, 96))
    flat = _model(2).forward(toks)
    all_flat = _model(2, indexer="hierarchical", flat_index_layers=(0, 1)).forward(toks)
    np.testing.assert_allclose(flat, all_flat, **TOL)
    # One flat layer of two: neither the flat nor the all-hierarchical model.
    one = _model(2, indexer="hierarchical", flat_index_layers=[1]).forward(toks)
    hier = _model(2, indexer="hierarchical").forward(toks)
    assert not np.allclose(flat[-1], one[-1], atol=1e-3)
    assert not np.allclose(hier[-1], one[-1], atol=1e-3)
    # The selections each pass made, captured from it: with layer 0 kept flat, layer 0
    # selects what the flat model's layer 0 does (same inputs); layer 1 does not.
    _, _, flats = ModelRunner(_model(2)).prefill(np.asarray(toks), chunk=32,
                                                 capture=("indices",), capture_from=64)
    mixed = _model(2, indexer="hierarchical", flat_index_layers=(0,))
    _, _, others = ModelRunner(mixed).prefill(np.asarray(toks), chunk=32,
                                              capture=("indices",), capture_from=64)
    flats, others = flats["indices"], others["indices"]
    assert flats.shape == (2, 32, mixed.config.top_k)
    np.testing.assert_array_equal(flats[0], others[0])
    assert not np.array_equal(flats[1], others[1])


@pytest.mark.parametrize("layers", [(2,), (-1,), (0, 0), ("0",), (True,), 0])
def test_bad_flat_index_layers_are_rejected(layers):
    with pytest.raises(ValueError, match=r"flat_index_layers must be distinct layer indices in "
                                         r"\[0, n_layers - 1 = 1\]"):
        get_config("tiny", flat_index_layers=layers)


def test_flat_index_layers_round_trip_through_json():
    config = get_config("tiny", indexer="hierarchical", flat_index_layers=[1, 0])
    assert config.flat_index_layers == (0, 1) and hash(config)
    again = ModelConfig.from_dict(json.loads(config.to_json()))
    assert again == config and again.layer_indexer(0) == "flat"
    assert config.replace(flat_index_layers=()).layer_indexer(0) == "hierarchical"
