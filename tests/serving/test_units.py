"""Pure parts of serving: the config, the prefix cache's LRU, incremental text with stop
strings, and the indexer-share estimate."""

import pathlib

import pytest

import model
from model.pretrained import ByteTokenizer
from serving.config import DEFAULT_CONFIG, config_from_mapping, load_config
from serving.metrics import context_bucket, indexer_prefill_share
from serving.prefix_cache import Block, PrefixCache, block_keys
from serving.text import TextStream

# ---------------------------------------------------------------------- config

def test_default_config_loads_with_the_reference_key_spellings():
    config = load_config(DEFAULT_CONFIG)
    assert config.model == "default" and config.cache_size == 4096
    upper = config_from_mapping({"COARSE_THRESHOLD": 0.8, "FINE_BATCH_SIZE": 64,
                                 "GPU_UTILIZATION": 0.5, "indexer": "hierarchical"})
    # A budget switch clears the other budgets (a model's length_budgets rule among them).
    assert upper.model_overrides() == {"indexer": "hierarchical", "hierarchical": dict(
        coarse_keep_ratio=0.8, candidate_tokens=None, length_budgets=None, fine_batch_size=64)}
    adaptive = config_from_mapping({"coarse": "learned", "coarse_mass": 0.9,
                                    "candidate_tokens": 4096})
    assert adaptive.model_overrides() == {"hierarchical": dict(
        candidate_tokens=4096, coarse_keep_ratio=None, length_budgets=None, coarse="learned",
        coarse_mass=0.9)}


@pytest.mark.parametrize("data,says", [
    ({"queue_size": 0}, "queue_size must be an integer in [1,"),
    ({"coarse_threshold": 1.5}, "coarse_threshold must be null or a number in (0, 1]"),
    ({"attention": "sparse-ish"}, "attention must be null or one of"),
    ({"indexer": "tree"}, "indexer must be null or one of"),
    ({"coarse": "max"}, "coarse must be null or one of ('mean', 'learned')"),
    ({"coarse_mass": 0}, "coarse_mass must be null or a number in (0, 1]"),
    ({"gpu_utilization": 0}, "gpu_utilization must be a number in (0, 1]"),
    ({"batching_window_ms": -1}, "batching_window_ms must be a number in [0"),
    ({"coarse_threshold": 0.5, "candidate_tokens": 512}, "at most one of coarse_threshold"),
    ({"cache_size": True}, "cache_size must be an integer"),
    ({"queue_sise": 3}, "unknown ServingConfig fields ['queue_sise']"),
    ({"TOP_K": 8, "top_k": 16}, "'top_k' is given twice"),
    ({"fp8_experts": "yes"}, "fp8_experts must be true or false"),
])
def test_bad_config_values_name_the_key_and_the_range(data, says):
    with pytest.raises(ValueError) as e:
        config_from_mapping(data)
    assert says in str(e.value)


def test_bad_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("queue_size: [1\n")
    with pytest.raises(ValueError, match="bad.yaml is not valid YAML"):
        load_config(path)
    path.write_text("max_context: 8\n")
    with pytest.raises(ValueError, match=r"bad.yaml: serving config: max_context"):
        load_config(path)


# ---------------------------------------------------------------------- prefix cache

def block(nbytes=100):
    return Block([], {"kv": nbytes // 2 + nbytes // 4, "index": nbytes // 4})


def test_block_keys_chain_over_the_whole_prefix():
    a = block_keys(list(range(12)), 4)
    b = block_keys(list(range(8)) + [99, 9, 10, 11], 4)
    c = block_keys([0] + list(range(1, 12)), 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2] and a == c
    assert block_keys([9, 9, 9, 9, 0, 1, 2, 3], 4)[1] != block_keys(list(range(4)), 4)[0]


def test_lookup_finds_the_longest_cached_prefix_and_limits_it():
    cache = PrefixCache(4, max_blocks=10, max_bytes=10_000)
    tokens = list(range(16))
    cache.insert(tokens, {i: block() for i in range(4)})
    _, found = cache.lookup(tokens, max_tokens=15)  # the last token always prefills
    assert len(found) == 3
    cache.release(found)
    _, found = cache.lookup(tokens[:8] + [0] * 8)
    assert len(found) == 2
    cache.release(found)
    assert cache.missing(tokens + list(range(4))) == [4]


def test_lru_evicts_by_entries_and_bytes_keeping_roots_and_held_blocks():
    cache = PrefixCache(2, max_blocks=3, max_bytes=10_000)
    cache.insert([1, 1, 2, 2, 3, 3], {i: block() for i in range(3)})
    cache.insert([7, 7], {0: block()})  # 4 blocks > 3: the deepest of the old chain goes
    assert len(cache) == 3
    _, found = cache.lookup([1, 1, 2, 2, 3, 3])
    assert len(found) == 2  # the root and its child survived, the leaf went first
    cache.insert([8, 8], {0: block()})  # the held blocks cannot go: [7, 7] does
    assert len(cache) == 3 and len(cache.lookup([7, 7])[1]) == 0
    cache.release(found)
    by_bytes = PrefixCache(2, max_blocks=100, max_bytes=250)
    by_bytes.insert([1, 1, 2, 2, 3, 3], {i: block() for i in range(3)})
    usage = by_bytes.usage()
    assert usage["blocks"] == 2 and usage["kv_bytes"] + usage["index_bytes"] <= 250
    assert usage["kv_bytes_per_token"] == 75 / 2 and usage["index_bytes_per_token"] == 25 / 2


def test_disabled_cache_holds_nothing():
    cache = PrefixCache(2, max_blocks=0, max_bytes=1000)
    cache.insert([1, 2], {0: block()})
    assert len(cache) == 0 and cache.lookup([1, 2, 3]) == ([], [])


# ---------------------------------------------------------------------- text

def feed(stream, text):
    pieces = [stream.add(b) for b in text.encode()]
    return pieces + [stream.flush()]


def test_text_holds_back_a_cut_character_and_a_possible_stop_string():
    stream = TextStream(ByteTokenizer(), stop=("END",))
    pieces = feed(stream, "né EN fin END after")
    assert "".join(pieces) == "né EN fin " and stream.stopped
    assert all("\ufffd" not in p for p in pieces)
    assert "n" in pieces and "" in pieces  # the 2-byte é waited for its second byte
    plain = TextStream(ByteTokenizer())
    assert "".join(feed(plain, "héllo")) == "héllo"


# ---------------------------------------------------------------------- indexer share

def test_indexer_share_estimate_grows_with_context_and_falls_with_hierarchy():
    small = model.get_config("small")
    flat = [indexer_prefill_share(small, 0, n) for n in (1024, 8192, 65536)]
    assert 0 < flat[0] < flat[1] < flat[2] < 1
    hier = small.replace(indexer="hierarchical")
    assert indexer_prefill_share(hier, 0, 65536) < flat[2]
    dense = small.replace(attention="dense")
    assert indexer_prefill_share(dense, 0, 65536) < flat[2]
    # A cached prefix leaves a short prefill that still scores every earlier key.
    assert indexer_prefill_share(small, 65000, 536) > indexer_prefill_share(small, 0, 536)
    assert [context_bucket(n) for n in (1, 256, 257, 5000)] == ["256", "256", "512", "8192"]


def test_fp8_experts_config_keeps_an_fp8_folders_experts_in_fp8():
    import jax.numpy as jnp

    from serving.loading import load_model

    folder = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dsa" / "deepseek_v32_fp8"
    loaded = load_model(str(folder), fp8_experts=True)
    moe = [b.mlp for b in map(loaded.model.layer, range(loaded.model.config.n_layers))
           if hasattr(b.mlp, "gate_scale")]
    assert moe and all(m.gate.get_value().dtype == jnp.float8_e4m3fn for m in moe)
    with pytest.raises(ValueError, match="fp8_experts applies to an FP8 DeepSeek-V3.2"):
        load_model("tiny", fp8_experts=True)
