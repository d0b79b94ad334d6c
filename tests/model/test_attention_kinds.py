"""The attention-kind table (model.attention_kinds) is the one list of attention kinds: a new
kind is its module, its entry and its cost entry. Here a toy kind defined in this file only
(GQA whose cache holds K and V packed in one field) is taken by the forward pass, the cache,
the sharding rules and the cost model without another file changing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import ModelRunner, Transformer, get_config
from model.attention import Attention
from model.attention_kinds import (
    ATTENTION_KINDS,
    AttentionKind,
    attention_kind,
    register_attention,
    unregister_attention,
)
from model.cache import bytes_per_token, init_cache, layer_fields, take_prefix
from model.cache_field import CacheField, model_dtype
from model.costs import ATTENTION_COSTS, gqa_attention, prefill_counts
from model.sharding import param_specs


class PackedAttention(Attention):
    """GQA whose cache row is [k | v]: one field instead of two."""

    def project(self, x, positions):
        q, rows, indexer_input = super().project(x, positions)
        return q, {"kv_packed": jnp.concatenate([rows["k"], rows["v"]], axis=-1)}, \
            indexer_input

    def read(self, rows):
        kv = rows["kv_packed"]
        return kv[..., :self.head_dim], kv[..., self.head_dim:]


PACKED = AttentionKind(
    "packed", PackedAttention, lambda c, layer: c.n_kv_heads == 1,  # the toy's configs
    {"kv_packed": CacheField("kv", lambda c: (c.n_kv_heads, 2 * c.head_dim), model_dtype,
                             ("cache_seq", "kv_heads", "head_dim"))},
    lambda c: None, ATTENTION_KINDS["gqa"].param_axes)


@pytest.fixture
def packed(monkeypatch):
    previous = register_attention(PACKED)
    monkeypatch.setitem(ATTENTION_COSTS, "packed", gqa_attention)  # its cost entry
    yield PACKED
    unregister_attention("packed", previous)


def _logits(config, tokens):
    model = Transformer(config, rngs=nnx.Rngs(0))
    return model, ModelRunner(model).prefill(tokens, logits_from=0)


def test_the_table_lists_each_kind_once():
    assert list(ATTENTION_KINDS) == ["gqa", "mla", "sliding", "csa", "hca"]
    assert attention_kind(get_config("tiny")).name == "gqa"
    assert attention_kind(get_config("deepseek-v3.2")).name == "mla"
    assert layer_fields(get_config("tiny"), 0)[:2] == ("k", "v")


def test_a_new_kind_is_one_entry_and_its_cost(packed):
    config = get_config("tiny", n_kv_heads=1, attention="sparse", indexer="flat")
    tokens = np.random.default_rng(0).integers(0, 256, 100)
    unregister_attention("packed")
    _, (want, _) = _logits(config, tokens)  # the same weights as GQA
    gqa_bytes, gqa_counts = bytes_per_token(config), prefill_counts(config, 100, skip=False)
    register_attention(packed)
    assert attention_kind(config) is packed
    model, (got, cache) = _logits(config, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Its field is what the cache holds, in prefix copies too.
    assert cache[0].names[0] == "kv_packed" and "k" not in cache[0].names
    assert cache[0].kv_packed.shape[2:] == (1, 2 * config.head_dim)  # [layers, rows, ...]
    assert set(take_prefix(cache, 64, config)[0]) == set(cache[0].names)
    assert init_cache(config, 128)[0].kv_packed.shape == (config.n_layers, 128, 1,
                                                          2 * config.head_dim)
    assert bytes_per_token(config) == gqa_bytes  # [k | v] packed: the same bytes
    # Its parameters are placed by its entry's axes; the cost model counts it.
    specs = param_specs(nnx.state(model))
    assert jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    counts = prefill_counts(config, 100, skip=False)
    assert counts.total().totals() == gqa_counts.total().totals()
