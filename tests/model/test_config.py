import pytest

from model import PRESETS, ModelConfig, get_config


def test_presets_are_valid():
    assert set(PRESETS) >= {"tiny", "small", "deepseek-v3.2"}
    v32 = get_config("deepseek-v3.2")
    assert (v32.index_heads, v32.index_dim, v32.index_rope_dim, v32.top_k) == (64, 128, 64, 2048)
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
