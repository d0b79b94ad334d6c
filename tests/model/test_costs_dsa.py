"""model.costs on DeepSeek-style models (MLA + DeepSeekMoE + the V3.2 / GLM-5 indexers):
cache bytes of the real presets, parameter counts against the module itself (nnx.eval_shape,
so the formula cannot drift from model/mla.py, model/moe.py, indexer/module.py), MoE and
absorbed-MLA FLOPs by hand."""

import jax
import numpy as np
import pytest
from flax import nnx

from model import Transformer, get_config
from model.architecture import MLAConfig, MoEConfig
from model.costs import (
    MOE,
    SHARED,
    attention_shape,
    cache_bytes_per_token,
    experts_touched,
    index_key_bytes,
    model_cache_bytes_per_token,
    parameter_count,
    prefill_counts,
)

V32 = get_config("deepseek-v3.2")
GLM5 = get_config("glm-5")
# A tiny DSA model with every per-layer kind: dense / MoE feed-forward, full / shared layers.
TINY_DSA = get_config(
    "tiny", n_layers=4, n_heads=4, n_kv_heads=4, head_dim=24, vocab_size=300,
    mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=12),
    moe=MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=20,
                  n_shared_experts=1, n_group=2, topk_group=1,
                  mlp_layer_types=("dense", "sparse", "sparse", "sparse")),
    indexer_types=("full", "shared", "full", "shared"), index_rope_dim=8)


def module_params(config):
    """nnx.Param count of the Transformer, from its shapes (no weights allocated)."""
    state = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


def test_v32_latent_cache_bytes_bf16_and_fp8_keys():
    per = cache_bytes_per_token(V32)
    assert per["kv"] == (512 + 64) * 2 and per["index_keys"] == 128 * 2
    assert per["kv"] + per["index_keys"] == 1408
    fp8 = cache_bytes_per_token(V32, index_fp8=True)
    # 128 FP8 values + one float32 scale per 128 values
    assert index_key_bytes(V32, fp8=True) == 132 and fp8["kv"] + fp8["index_keys"] == 1284
    assert model_cache_bytes_per_token(V32)["kv"] == 61 * 1152
    # GLM-5: the same latent and key sizes; its shared-layer schedule caches keys in 21 of 78
    shared = GLM5.replace(indexer_types={"index_topk_freq": 4, "index_skip_topk_offset": 3})
    assert cache_bytes_per_token(GLM5)["kv"] + cache_bytes_per_token(GLM5)["index_keys"] == 1408
    assert model_cache_bytes_per_token(shared, index_fp8=True)["index_keys"] == 21 * 132
    assert model_cache_bytes_per_token(shared)["kv"] == 78 * 1152


def test_v32_and_glm5_parameters_total_and_active():
    # DeepSeek-V3's published 671B total / 37B activated, plus V3.2's indexers (0.86B).
    assert parameter_count(V32) == 671_877_944_064
    assert parameter_count(V32, active=True) == 38_403_822_336
    assert parameter_count(V32, active=True, embeddings=False) == 37_477_143_296
    # GLM-5: published 744B total, 40B activated.
    assert parameter_count(GLM5) == 743_911_218_432
    assert parameter_count(GLM5, active=True, embeddings=False) == 40_833_146_112


def test_parameter_count_matches_the_module_of_a_tiny_dsa_model():
    assert parameter_count(TINY_DSA) == module_params(TINY_DSA)
    # Active: the routed experts a token runs (2 of 8) instead of all, per MoE layer.
    m, D = TINY_DSA.moe, TINY_DSA.d_model
    idle = 3 * (m.n_routed_experts - m.num_experts_per_tok) * 3 * D * m.moe_intermediate_size
    assert parameter_count(TINY_DSA, active=True) == module_params(TINY_DSA) - idle
    assert parameter_count(TINY_DSA, active=True, embeddings=False) == \
        module_params(TINY_DSA) - idle - TINY_DSA.vocab_size * D
    absorbed_off = TINY_DSA.replace(mla=TINY_DSA.mla.replace(absorb=False))
    assert parameter_count(absorbed_off) == module_params(absorbed_off)


@pytest.mark.slow  # traces the 61-layer model's shapes (~5 s)
def test_parameter_count_matches_the_full_size_v32_module():
    assert parameter_count(V32) == module_params(V32)


def test_absorbed_mla_attention_by_hand():
    a = attention_shape(V32)
    assert (a.heads, a.kv_heads, a.qk_dim, a.v_dim, a.kv_row, a.cached) == (
        128, 1, 576, 512, 576, 576)
    # q_a, q_b, kv_a, kv_b, o of V3's config
    assert a.params == (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
                        + 128 * 128 * 7168)
    counts = prefill_counts(TINY_DSA, 256, skip=True, indexer="flat")
    ops = {op.name: op for op in counts.per_layer["flat" + MOE]}
    # One (query, selected token): 2 x H x (latent + kv_lora) FLOPs, a 24-value row read.
    entries = sum(min(16, p + 1) for p in range(256))
    assert ops["sparse attention"].flops == 2 * 4 * (24 + 16) * entries
    assert ops["sparse attention"].gather_bytes == entries * 24 * 4
    expanded = TINY_DSA.replace(mla=TINY_DSA.mla.replace(absorb=False))
    e_ops = {op.name: op for op in prefill_counts(expanded, 256, skip=True,
                                                  indexer="flat").per_layer["flat" + MOE]}
    # The expanded form first turns each read latent row into 4 heads of [k_nope | v].
    assert e_ops["expand latent"].flops == 4 * 2 * (16 * 4 * (16 + 12)) * 256


def test_moe_and_shared_layers_by_hand():
    counts = prefill_counts(TINY_DSA, 256, skip=True, indexer="flat")
    assert counts.layers == ("flat", SHARED + MOE, "flat" + MOE, SHARED + MOE)
    T, D, E, k, F = 256, 64, 8, 2, 20
    moe = {op.name: op for op in counts.per_layer["flat" + MOE]}
    dense = {op.name: op for op in counts.per_layer["flat"]}
    shared = {op.name: op for op in counts.per_layer[SHARED + MOE]}
    assert moe["routed experts"].flops == 2 * 3 * D * F * T * k  # 4 chunks of 64
    assert moe["router"].flops == 2 * D * E * T
    assert moe["shared experts"].flops == 2 * 3 * D * F * T
    assert "mlp" not in moe and dense["mlp"].flops == 2 * 3 * D * TINY_DSA.d_ff * T
    # Each chunk of 64 tokens reads the weights of every expert it routes to (~all 8).
    touched = experts_touched(E, k, 64)
    assert touched == pytest.approx(8 * (1 - (6 / 8) ** 64))
    assert moe["routed experts"].bytes == pytest.approx(
        4 * (touched * 3 * D * F * 4 + 64 * k * (2 * D + 3 * F) * 4))
    # A shared layer has no indexer: no projections, no selection, no index keys written.
    assert "indexer projections" not in shared and "flat scores" not in shared
    assert moe["indexer projections"].flops == 2 * (24 * 2 * 16 + D * (16 + 2)) * T
    assert shared["cache writes"].bytes == T * 24 * 4
    total = counts.total().totals()
    assert total["indexer"]["flops"] == 2 * counts.per_layer["flat"].totals()["indexer"]["flops"]
