import pytest

from model import PRESETS, ModelConfig, get_config
from model.config import keep_layers


def test_the_deepseek_v4_flash_preset_is_its_published_size():
    """transformers' DeepseekV4Config defaults (DeepSeek-V4-Flash-Base) through the folder
    loader's mapping: the issue's layer counts, and 284B parameters as published (counted
    from the model's shapes by model.memory, bf16 with float32 norms and router)."""
    from collections import Counter

    from model.memory import param_bytes_per_device

    flash = get_config("deepseek-v4-flash")
    assert Counter(flash.v4.layer_types) == {"sliding": 2, "csa": 21, "hca": 20}
    assert (flash.d_model, flash.n_heads, flash.head_dim, flash.top_k, flash.index_heads,
            flash.index_dim, flash.v4.csa_ratio, flash.v4.hca_ratio) == (
        4096, 64, 512, 512, 64, 128, 4, 128)
    assert flash.moe.mlp_layer_types[:4] == ("hash",) * 3 + ("sparse",)
    _, total = param_bytes_per_device(flash, {})
    assert 283e9 < total / 2 < 286e9


def test_presets_are_valid():
    assert set(PRESETS) >= {"tiny", "small", "deepseek-v3.2", "glm-5", "deepseek-v4-flash",
                            "deepseek-v4-pro"}
    v32 = get_config("deepseek-v3.2")
    assert (v32.index_heads, v32.index_dim, v32.index_rope_dim, v32.top_k) == (64, 128, 64, 2048)
    # The real architecture (the loader's mapping of its config.json), not a GQA stand-in.
    assert (v32.d_model, v32.n_layers, v32.n_heads, v32.vocab_size, v32.dtype) == (
        7168, 61, 128, 129280, "bfloat16")
    assert (v32.mla.q_lora_rank, v32.mla.kv_lora_rank, v32.mla.qk_nope_head_dim,
            v32.mla.qk_rope_head_dim, v32.mla.v_head_dim) == (1536, 512, 128, 64, 128)
    m = v32.moe
    assert (m.n_routed_experts, m.num_experts_per_tok, m.moe_intermediate_size,
            m.n_shared_experts, m.n_group, m.topk_group, m.routed_scaling_factor) == (
        256, 8, 2048, 1, 8, 4, 2.5)
    assert m.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 58 and v32.d_ff == 18432
    assert v32.yarn.factor == 40.0 and not v32.index_rope_interleaved
    glm = get_config("glm-5")
    assert (glm.d_model, glm.n_layers, glm.n_heads, glm.index_heads, glm.vocab_size) == (
        6144, 78, 64, 32, 154880)
    assert (glm.mla.q_lora_rank, glm.mla.qk_nope_head_dim, glm.mla.v_head_dim) == (
        2048, 192, 256)
    assert glm.index_rope_interleaved and glm.indexer_types == ()


def test_keep_layers_keeps_each_layers_kinds():
    v32 = get_config("deepseek-v3.2")
    four = keep_layers(v32, [2, 3, 4, 5])  # the last dense layer and three MoE layers
    assert four.n_layers == 4 and four.moe.mlp_layer_types == ("dense",) + ("sparse",) * 3
    assert four.mla == v32.mla and four.d_model == 7168
    glm = get_config("glm-5", indexer_types="FSSF" * 19 + "FS", flat_index_layers=(3,))
    cut = keep_layers(glm, [0, 1, 3])
    assert cut.indexer_types == ("full", "shared", "full") and cut.flat_index_layers == (2,)
    with pytest.raises(ValueError, match="layer 0 must be 'full'"):
        keep_layers(glm, [1, 3])
    with pytest.raises(ValueError, match=r"keep_layers: layers must be .* in \[0, 60\]"):
        keep_layers(v32, [61])
    small = get_config("small")
    assert small.index_heads == 4 and 32 <= small.index_dim <= 64 and small.top_k == 256


@pytest.mark.parametrize("field,value,message", [
    ("d_model", 0, "d_model must be a positive int"),
    ("n_heads", 7, "n_heads .* multiple of n_kv_heads"),
    ("head_dim", 15, "head_dim must be even"),
    ("index_rope_dim", 100, "index_rope_dim must be even and in"),
    ("attention", "local", r"attention must be one of \('dense', 'sparse'\)"),
    ("indexer", "magic", "indexer must be one of"),
    ("vocab_size", 0, "vocab_size must be a positive int"),
    ("rope_scaling", -1.0, "rope_scaling must be a positive number"),
    ("index_rope_scaling", 0.0, "index_rope_scaling must be None or a positive number"),
    ("top_k", 2.5, "top_k must be a positive int"),
])
def test_bad_configs_are_rejected_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{field: value})


def test_unknown_preset_and_fields():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        get_config("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({"d_modle": 3})
    assert ModelConfig.from_dict(get_config("tiny").to_dict()) == get_config("tiny")
