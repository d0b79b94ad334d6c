"""The oracle selection kind (indexer.selection "oracle"): each sparse layer keeps the top_k
tokens of its own dense attention averaged over heads, from the same pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from indexer.scoring import oracle_select
from model import ModelRunner, Transformer, get_config, with_config


def _tokens(seed, n):
    return np.asarray(jax.random.randint(jax.random.key(seed), (n,), 0, 256), np.int32)


def test_oracle_select_is_the_top_k_of_the_visible_target():
    rng = np.random.default_rng(0)
    T, L, k, q0 = 7, 37, 5, 20
    target = rng.random((T, L)).astype(np.float32)
    got = np.asarray(oracle_select(jnp.asarray(target), k, q_offset=q0))
    for t in range(T):
        seen = q0 + t + 1
        want = np.argsort(-target[t, :seen], kind="stable")[:k]
        np.testing.assert_array_equal(got[t], want)
    early = np.asarray(oracle_select(jnp.asarray(target[:2]), 8, q_offset=3))
    np.testing.assert_array_equal(early[0, 4:], -1)  # 4 keys visible at position 3
    assert set(early[0, :4]) == {0, 1, 2, 3}


def test_the_first_sparse_layer_keeps_the_top_k_of_the_dense_pass_attention():
    model = Transformer(get_config("tiny", top_k=16), rngs=nnx.Rngs(3))
    toks = _tokens(4, 90)
    _, _, dense = ModelRunner(with_config(model, model.config.replace(attention="dense"))) \
        .prefill(toks, capture=("attention_target",), chunk=32)
    oracle = with_config(model, model.config.replace(attention="sparse", indexer="oracle"))
    _, _, got = ModelRunner(oracle).prefill(toks, capture=("indices",), chunk=32)
    layer0 = dense["attention_target"][0]  # layer 0 sees the same inputs in both passes
    for t in range(len(toks)):
        want = np.argsort(-layer0[t, :t + 1], kind="stable")[:16]
        row = got["indices"][0, t]
        np.testing.assert_array_equal(np.sort(row[row >= 0]), np.sort(want))


@pytest.mark.slow  # a heavy equivalence: default-tier headroom
def test_an_oracle_that_keeps_every_token_is_dense():
    model = Transformer(get_config("tiny", top_k=64), rngs=nnx.Rngs(5))
    toks = jnp.asarray(_tokens(6, 60))
    dense = with_config(model, model.config.replace(attention="dense")).forward(toks)
    oracle = with_config(model, model.config.replace(attention="sparse", indexer="oracle"))
    np.testing.assert_allclose(oracle.forward(toks), dense, rtol=2e-4, atol=2e-4)


def test_the_oracle_is_not_served():
    from serving.config import ServingConfig

    with pytest.raises(ValueError, match="indexer"):
        ServingConfig(indexer="oracle")
