"""The engine against the runner it wraps (tiny model, random weights): the batched decode
step equals one decode per sequence, and a prefill from the prefix cache gives the logits
of a cold prefill (also with a layer that reuses another's selection)."""

import flax.nnx as nnx
import jax
import numpy as np
import pytest

import model
from serving.engine import Engine, Sampling
from serving.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def tiny():
    return model.Transformer(model.get_config("tiny"), rngs=nnx.Rngs(1))


def test_decode_batch_equals_one_decode_per_sequence(tiny):
    runner = model.ModelRunner(tiny)
    prompts = [np.arange(1, 40) % 250, np.arange(5, 300) % 250]
    slots = runner.new_batch_cache(2, 512)
    expected = []
    for i, prompt in enumerate(prompts):
        _, cache = runner.prefill(prompt, capacity=512)
        slots = jax.tree.map(lambda s, c, i=i: s.at[i].set(c), slots, cache)
        logits, _ = runner.decode(3, jax.tree.map(np.copy, cache), len(prompt))
        expected.append(np.asarray(logits))
    logits, _ = runner.decode_batch(np.array([3, 3]), slots,
                                    np.array([len(p) for p in prompts]))
    np.testing.assert_allclose(np.asarray(logits), np.stack(expected), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cache holds 512 positions"):
        runner.decode_batch(np.array([3, 3]), slots, np.array([512, 0]))


@pytest.mark.parametrize("indexer_types", ["", "FS"])  # FS: layer 1 caches no index keys
def test_prefill_from_the_prefix_cache_matches_a_cold_prefill(tiny, indexer_types):
    net = model.with_config(tiny, tiny.config.replace(indexer_types=indexer_types))
    engine = Engine(net, max_context=512, slots=2,
                    prefix_cache=PrefixCache(64, max_blocks=100, max_bytes=1 << 30))
    prompt = np.random.default_rng(0).integers(0, 256, 300)

    def prefill(tokens):
        state = engine.begin_prefill(tokens)
        while not state.done:
            engine.prefill_step(state)
        token = engine.first_token(state, Sampling())
        engine.cache_prompt(state)
        return state.cache_hit_tokens, np.asarray(state.logits), token

    cold_hit, cold, cold_token = prefill(prompt)
    warm_hit, warm, warm_token = prefill(prompt)
    assert (cold_hit, warm_hit) == (0, 256)
    np.testing.assert_allclose(warm, cold, rtol=1e-5, atol=1e-5)
    assert warm_token == cold_token
    usage = engine.prefix_cache.usage()
    # Per token: K and V of 2 kv heads x 16 f32 in each of 2 layers; the index part, the
    # indexer key (16 f32) + its share of the block summaries ((3 x 16 + 2) x 4 bytes per
    # block of 8) in each full layer.
    assert usage["blocks"] == 4 and usage["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    full = 2 - indexer_types.count("S")
    assert usage["index_bytes_per_token"] == full * (16 * 4 + (3 * 16 + 2) * 4 / 8)
