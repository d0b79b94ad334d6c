"""DeepSeek-V4 in the cost model (model.costs with model/deepseek_v4/costs.py): the
parameters it counts equal the model's own, and the pairs it counts for the window, the
entries and the selection over entries equal a position-by-position count."""

import jax
import numpy as np
import pytest
from flax import nnx

from indexer.costs import Selection, entry_pairs, flat_ops, hierarchical_ops
from model import Transformer, get_config
from model.costs import ATTENTION_COSTS, countable, parameter_count, prefill_counts
from model.deepseek_v4.costs import v4_attention_ops

FLASH = get_config("deepseek-v4-flash")
TINY_V4 = get_config("deepseek-v4-flash").replace(
    vocab_size=300, d_model=64, n_layers=4, n_heads=4, head_dim=32, index_heads=4,
    index_dim=16, index_rope_dim=8, top_k=6,
    moe=FLASH.moe.replace(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          mlp_layer_types=("hash", "sparse", "sparse", "sparse")),
    v4=FLASH.v4.replace(layer_types=("sliding", "csa", "hca", "csa"), q_lora_rank=32,
                        qk_rope_head_dim=8, o_groups=2, o_lora_rank=16, sliding_window=16,
                        hca_ratio=16))


def _nnx_parameters(config):
    state = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


@pytest.mark.parametrize("config", [TINY_V4, FLASH], ids=["tiny", "flash"])
def test_the_counted_parameters_are_the_models(config):
    assert countable(config)
    assert parameter_count(config) == _nnx_parameters(config)


def test_the_flash_preset_counts_284b_parameters_and_13b_active_without_embeddings():
    assert round(parameter_count(FLASH) / 1e9, 1) == 284.3
    assert 12.5e9 < parameter_count(FLASH, active=True, embeddings=False) < 13.5e9


def test_the_pro_preset_is_the_released_1_6t_model():
    """DeepSeek's figures for V4-Pro: 1.6T parameters, 49B active, both with its MTP layer,
    which dosa skips (one more of its 61 layers' blocks: about 25B). (That the count is the
    modules' own: the test above, on V4-Flash's kinds of layers.)"""
    pro = get_config("deepseek-v4-pro")
    assert pro.v4.layer_types.count("csa") == 30 and pro.v4.layer_types.count("hca") == 31
    assert pro.top_k == 1024 and pro.hierarchical.candidate_tokens == 4096
    assert 1.55e12 < parameter_count(pro) < 1.6e12
    assert 48e9 < parameter_count(pro, active=True) < 50e9


def _brute(p0, T, fn):
    return sum(fn(p) for p in range(p0, p0 + T))


@pytest.mark.parametrize("p0, T, kv_len", [(0, 37, 64), (100, 29, 256), (5000, 1, 8192)])
def test_window_entry_and_selection_pairs_are_counted_position_by_position(p0, T, kv_len):
    c, b = TINY_V4, 2
    W, r, top_k = c.v4.sliding_window, c.v4.csa_ratio, c.top_k
    n = kv_len // r
    assert entry_pairs(p0, T, n, r) == _brute(p0, T, lambda p: min(n, (p + 1) // r))
    per_pair = 2 * c.n_heads * 2 * c.head_dim
    for kind, entries in (("sliding", lambda p: 0),
                          ("csa", lambda p: min(top_k, (p + 1) // r)),
                          ("hca", lambda p: min(kv_len // 16, (p + 1) // 16))):
        a = ATTENTION_COSTS[kind](c)
        (op,) = [o for o in v4_attention_ops(a, T, p0, kv_len, top_k, b, True)
                 if o.stage == "attention"]
        want = _brute(p0, T, lambda p, e=entries: min(W, p + 1) + e(p))
        assert op.flops == per_pair * want, kind
    flat = Selection("flat", c.index_heads, c.index_dim, top_k, b, key_ratio=r)
    scores = next(o for o in flat_ops(flat, T, p0, n, True) if o.name == "flat scores")
    assert scores.flops == 2 * c.index_heads * c.index_dim * _brute(
        p0, T, lambda p: min(n, (p + 1) // r))
    hier = Selection("hierarchical", c.index_heads, c.index_dim, top_k, b,
                     c.hierarchical.replace(block_size=4, candidate_tokens=8, query_tile=1),
                     key_ratio=r)
    coarse = next(o for o in hierarchical_ops(hier, T, p0, n, True) if o.name == "coarse scores")
    nb = -(-n // 4)
    assert coarse.flops == 2 * c.index_heads * c.index_dim * _brute(
        p0, T, lambda p: min(nb, max((p + 1) // r - 1, -1) // 4 + 1))


def test_a_v4_prefill_is_counted_per_layer_kind():
    counts = prefill_counts(TINY_V4, 300, skip=True, indexer="hierarchical")
    assert counts.layers == ("sliding+moe", "csa/hierarchical+moe", "hca+moe",
                             "csa/hierarchical+moe")
    flat = prefill_counts(TINY_V4, 300, skip=True, indexer="flat").total().totals()
    hier = counts.total().totals()
    assert hier["other"] == flat["other"] and hier["attention"] == flat["attention"]
    assert 0 < hier["indexer"]["flops"] and "indexer" not in counts.per_layer["hca+moe"].totals()
