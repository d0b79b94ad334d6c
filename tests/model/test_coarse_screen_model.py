"""The learned coarse screen inside the model: its file, per-layer budgets, decode = prefill."""

import jax
import numpy as np
import pytest
from flax import nnx

from model import ModelRunner, Transformer, get_config, load_default_model, save_checkpoint
from model.coarse_screen_file import (
    CoarseScreenFileError,
    load_coarse_screen,
    read_screen_record,
    save_coarse_screen,
)


def _model(seed=0, **overrides):
    return Transformer(get_config("tiny", **overrides), rngs=nnx.Rngs(seed))


def _perturb_screens(model, seed=7, scale=0.05):
    """Non-trivial screens (a trained one is not the identity)."""
    keys = jax.random.split(jax.random.key(seed), model.config.n_layers)
    for i, key in enumerate(keys):
        layer = model.layer(i)  # a copy: written back below
        p = layer.coarse_screen.scales
        p[...] = p[...] + scale * jax.random.normal(key, p[...].shape)
        layer.coarse_screen.log_temperature[...] = np.float32(-0.5)
        model.set_layer(i, layer)
    return model


def test_screen_file_round_trip_and_fingerprint(tmp_path):
    trained = _perturb_screens(_model(0))
    save_coarse_screen(tmp_path, trained, record={"steps": 3})
    fresh = _model(0)  # same weights, untrained screens
    assert read_screen_record(tmp_path) == {"steps": 3}
    assert load_coarse_screen(tmp_path, fresh) == {"steps": 3}
    for i in range(trained.config.n_layers):
        np.testing.assert_array_equal(trained.layer(i).coarse_screen.scales[...],
                                      fresh.layer(i).coarse_screen.scales[...])
    # Screens distilled from another indexer are refused, naming the file.
    with pytest.raises(CoarseScreenFileError, match="coarse_screen.safetensors: these coarse "
                                                    "screens were distilled from another"):
        load_coarse_screen(tmp_path, _model(1))
    (tmp_path / "coarse_screen.safetensors").write_bytes(b"junk")
    with pytest.raises(CoarseScreenFileError, match="not a readable safetensors file"):
        load_coarse_screen(tmp_path, fresh)


def test_checkpoint_restore_attaches_screens_and_learned_needs_them(tmp_path):
    model = _model(0)
    save_checkpoint(tmp_path, model)
    with pytest.raises(ValueError, match="coarse='learned' needs trained coarse screens"):
        load_default_model(tmp_path, indexer="hierarchical",
                           hierarchical={"coarse": "learned", "block_size": 8,
                                         "candidate_tokens": 32})
    # The orbax checkpoint never holds the screens (not nnx.Param): restored untrained ...
    restored, _ = load_default_model(tmp_path)
    np.testing.assert_array_equal(restored.layer(0).coarse_screen.scales[...],
                                  model.layer(0).coarse_screen.scales[...])
    # ... and then from the screen file beside it.
    save_coarse_screen(tmp_path, _perturb_screens(model))
    restored, _ = load_default_model(tmp_path, indexer="hierarchical",
                                     hierarchical={"coarse": "learned", "block_size": 8,
                                                   "candidate_tokens": 32})
    np.testing.assert_array_equal(restored.layer(1).coarse_screen.scales[...],
                                  model.layer(1).coarse_screen.scales[...])


def test_layer_candidate_tokens():
    config = get_config("tiny", indexer="hierarchical", layer_candidate_tokens=[32, 48])
    assert config.layer_hierarchical(0).candidate_tokens == 32
    assert config.layer_hierarchical(1).candidate_tokens == 48
    assert config.layer_hierarchical(None) == config.hierarchical
    for bad in ([32], [32, 8], [32, "48"]):
        with pytest.raises(ValueError, match=r"layer_candidate_tokens must be empty .* or 2 "
                                             r"ints \(one per layer\), each >= top_k \(16\)"):
            get_config("tiny", layer_candidate_tokens=bad)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
@pytest.mark.parametrize("mass", [None, 0.6])
def test_learned_screen_decode_equals_prefill_and_differs_from_mean(mass):
    hier = get_config("tiny").hierarchical.replace(coarse="learned", coarse_mass=mass)
    model = _perturb_screens(_model(4, indexer="hierarchical", hierarchical=hier), scale=0.3)
    runner = ModelRunner(model)
    toks = np.asarray(jax.random.randint(jax.random.key(6), (75,), 0, 256), np.int32)
    logits, cache = runner.prefill(toks[:60], capacity=75)
    for i, t in enumerate(toks[60:]):
        logits, cache = runner.decode(int(t), cache, 60 + i)
    want, _ = runner.prefill(toks)
    np.testing.assert_allclose(logits, want, rtol=2e-4, atol=2e-4)
    # The learned screen selected otherwise than the mean one (it is really used).
    _, _, learned = runner.prefill(toks, capture=("indices",), capture_from=40)
    mean_model = _perturb_screens(_model(4, indexer="hierarchical",
                                         hierarchical=hier.replace(coarse="mean")), scale=0.3)
    _, _, mean = ModelRunner(mean_model).prefill(toks, capture=("indices",), capture_from=40)
    assert not np.array_equal(learned["indices"], mean["indices"])
