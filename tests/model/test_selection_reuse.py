"""Per-layer selection reuse (ModelConfig.indexer_types, GLM-5's "shared" layers,
IndexCache): a shared layer attends to the selection of the nearest earlier full layer, runs
no indexer and caches no index keys, in prefill, decode, batched decode and the prefix
cache (tests/serving/test_engine.py); GLM-5's own spellings of the schedule are
accepted."""

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.evaluation.metrics import selections_on_captured
from model import ModelRunner, Transformer, get_config, with_config
from model.cache import layer_of
from model.config import ModelConfig, glm_indexer_types, normalize_indexer_types, reuse_types

TOL = dict(rtol=2e-4, atol=2e-4)
N = 120  # two chunks of 64 (the last one padded): one compiled step per model


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


@pytest.fixture(scope="module")
def full():
    """Three full layers, hierarchical selection (the tiny budget of 32 candidate tokens is
    below the context, so it selects differently from flat)."""
    return Transformer(get_config("tiny", n_layers=3, indexer="hierarchical"),
                       rngs=nnx.Rngs(3))


# flat: default-tier time budget, in the slow tier
@pytest.mark.parametrize("indexer", [pytest.param("flat", marks=pytest.mark.slow), "hierarchical"])
def test_a_shared_layer_attends_to_its_full_layers_selection(full, indexer):
    """FFS: layer 2 reuses layer 1's selection (the nearest full layer, not layer 0's). The
    full layers select exactly as in the all-full model with the same weights, the shared
    one holds no indexer weights and no index cache."""
    base = with_config(full, full.config.replace(indexer=indexer))
    shared = with_config(full, base.config.replace(indexer_types="FFS"))
    assert shared.layer(2).indexer is None and shared.layer(1).indexer is not None
    _, cache, got = ModelRunner(shared).prefill(_tokens(0, N), capture=("indices", "indexer"))
    _, ref_cache, ref = ModelRunner(base).prefill(_tokens(0, N), capture=("indices",
                                                                           "indexer"))
    np.testing.assert_array_equal(got["indices"][2], got["indices"][1])
    # The evaluation scores a reuse pattern on the all-full pass's captures: the shared
    # layer gets its full layer's selection there too.
    on_captured = selections_on_captured(shared.config, ref, ref_cache, 0, N)
    np.testing.assert_array_equal(on_captured, got["indices"])
    np.testing.assert_array_equal(got["indices"][:2], ref["indices"][:2])
    assert not np.array_equal(got["indices"][1], got["indices"][0])
    # The shared layer's captured indexer inputs are its full layer's (a KL on them trains
    # that indexer for both layers).
    for part in ("q", "w", "k"):
        np.testing.assert_array_equal(getattr(got["indexer"], part)[2],
                                      getattr(got["indexer"], part)[1])
    layer = [layer_of(cache, shared.config, i) for i in range(3)]
    assert not layer[2].has_index and layer[2].summaries is None and layer[1].has_index


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_shared_prefill_chunked_then_decoded_equals_one_forward(full):
    shared = with_config(full, full.config.replace(indexer_types="FSS"))
    runner = ModelRunner(shared)
    toks = _tokens(1, N + 4)
    logits, cache = runner.prefill(toks[:N], capacity=N + 4)
    for i, t in enumerate(toks[N:]):
        logits, cache = runner.decode(int(t), cache, N + i)
    want = shared.forward(jax.numpy.asarray(toks))[-1]
    np.testing.assert_allclose(logits, want, **TOL)
    # Serving's batched decode (a vmap of the step) over slots with shared layers.
    _, one = runner.prefill(toks[:N], capacity=512)
    slots = jax.tree.map(lambda s, c: s.at[1].set(c), runner.new_batch_cache(2, 512), one)
    batch, _ = runner.decode_batch(np.array([0, int(toks[N])]), slots, np.array([0, N]))
    step, _ = runner.decode(int(toks[N]), one, N)
    np.testing.assert_allclose(np.asarray(batch)[1], step, rtol=1e-5, atol=1e-5)


def test_a_shared_layer_cannot_be_made_full_again(full):
    shared = with_config(full, full.config.replace(indexer_types="FFS"))
    with pytest.raises(ValueError, match="weights the model does not have.*layers/2"):
        with_config(shared, shared.config.replace(indexer_types=()))


def test_indexer_types_spellings():
    # GLM-5's schedule (transformers' GlmMoeDsaConfig): full while i < offset, then one in
    # index_topk_freq.
    assert glm_indexer_types(8, index_topk_freq=4, index_skip_topk_offset=2) == (
        "full", "full", "shared", "shared", "shared", "full", "shared", "shared")
    assert normalize_indexer_types({"index_topk_freq": 4, "index_skip_topk_offset": 2}, 8) \
        == normalize_indexer_types("FFSSSFSS", 8) \
        == normalize_indexer_types({"index_topk_pattern": "FFSSSFSS"}, 8)
    assert normalize_indexer_types(["full"] * 4, 4) == () == normalize_indexer_types("", 4)
    # The short spellings of benchmarks and evaluation methods ("@freq2", --reuse FSFS).
    assert normalize_indexer_types(reuse_types("freq2"), 6) == normalize_indexer_types(
        "FSFSFS", 6)
    assert normalize_indexer_types(reuse_types("freq4"), 6) == normalize_indexer_types(
        "FSSSFS", 6)
    assert reuse_types("FFSS") == "FFSS"
    assert ModelConfig(indexer_types="FFFF") == ModelConfig()
    config = ModelConfig(n_layers=4, indexer_types="FSFS")
    assert [config.selection_source(i) for i in range(4)] == [0, 0, 2, 2]
    assert ModelConfig.from_dict(config.to_dict()) == config
    for bad, match in [("SFFF", "layer 0 must be 'full'"), ("FFS", "one entry per layer"),
                       ("FXFF", "only the letters F"), ({"freq": 2}, "unknown keys"),
                       ({"index_topk_freq": 0}, "index_topk_freq must be an int >= 1")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig(indexer_types=bad)
    with pytest.raises(ValueError, match=r"flat_index_layers: layers \[1\] are 'shared'"):
        ModelConfig(indexer_types="FSFF", flat_index_layers=(1,))
