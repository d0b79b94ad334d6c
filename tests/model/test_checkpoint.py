import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import Transformer, get_config, restore_checkpoint, save_checkpoint


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_round_trip_restores_weights_config_and_metadata(tmp_path):
    model = Transformer(get_config("tiny"), rngs=nnx.Rngs(11))
    save_checkpoint(tmp_path / "ckpt", model, step=3, metadata={"note": "hello"})
    restored, metadata, _ = restore_checkpoint(tmp_path / "ckpt")
    assert restored.config == model.config and metadata == {"note": "hello"}
    toks = jnp.asarray(np.arange(30) % 256, jnp.int32)
    np.testing.assert_array_equal(model.forward(toks), restored.forward(toks))
    # Run-time switches may change on load.
    dense, _, _ = restore_checkpoint(tmp_path / "ckpt", get_config("tiny", attention="dense"))
    assert dense.config.attention == "dense"
    np.testing.assert_array_equal(nnx.state(dense, nnx.Param)["embed"]["embedding"][...],
                                  nnx.state(model, nnx.Param)["embed"]["embedding"][...])


def test_restoring_into_a_mismatching_config_fails_clearly(tmp_path):
    save_checkpoint(tmp_path / "ckpt", Transformer(get_config("tiny"), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="d_model: checkpoint has 64, requested 96"):
        restore_checkpoint(tmp_path / "ckpt", get_config("tiny", d_model=96))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        restore_checkpoint(tmp_path / "nothing")
