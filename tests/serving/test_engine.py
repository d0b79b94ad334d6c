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


def _prefill(engine, tokens):
    """A prompt through the engine as the scheduler runs it -> (cache hit tokens, last
    logits, first token); its full blocks then go into the prefix cache."""
    state = engine.begin_prefill(tokens)
    while not state.done:
        engine.prefill_step(state)
    token = engine.first_token(state, Sampling())
    engine.cache_prompt(state)
    return state.cache_hit_tokens, np.asarray(state.logits), token


@pytest.mark.parametrize("indexer_types", ["", "FS"])  # FS: layer 1 caches no index keys
def test_prefill_from_the_prefix_cache_matches_a_cold_prefill(tiny, indexer_types):
    net = model.with_config(tiny, tiny.config.replace(indexer_types=indexer_types))
    engine = Engine(net, max_context=512, slots=2,
                    prefix_cache=PrefixCache(64, max_blocks=100, max_bytes=1 << 30))
    prompt = np.random.default_rng(0).integers(0, 256, 300)

    cold_hit, cold, cold_token = _prefill(engine, prompt)
    warm_hit, warm, warm_token = _prefill(engine, prompt)
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


@pytest.mark.slow  # 30 s: the fixture's prefill shapes at 1024 positions
def test_deepseek_v4_reuses_a_prefix_where_its_state_was_saved():
    """The tiny DeepSeek-V4 fixture (its cache keeps rings: the window and the compressors'
    tails) with blocks of 256 positions: a 600-token prompt saves its state at 512, the end
    of its last full block; a prompt that shares its first 530 tokens then starts from 512
    (not from 256, whose end has no saved state), and its logits and first token are a cold
    prefill's. A block size that splits the cache's rows is refused, naming it."""
    import pathlib

    from model.pretrained.registry import load_pretrained

    folder = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "deepseek_v4" / "tiny"
    net = load_pretrained(folder).model
    with pytest.raises(ValueError, match=r"cache_block_tokens \(64\) must be a multiple of 256"):
        Engine(net, max_context=1024, slots=1,
               prefix_cache=PrefixCache(64, max_blocks=100, max_bytes=1 << 30))
    engine = Engine(net, max_context=1024, slots=1, prefill_chunk=384,
                    prefix_cache=PrefixCache(256, max_blocks=100, max_bytes=1 << 30))
    rng = np.random.default_rng(0)
    first = rng.integers(0, 512, 600)
    second = np.concatenate([first[:530], rng.integers(0, 512, 40)])

    assert _prefill(engine, first)[0] == 0
    usage = engine.prefix_cache.usage()
    assert usage["blocks"] == 2 and usage["state_bytes"] > 0
    hit, warm, warm_token = _prefill(engine, second)
    assert hit == 512
    cold_logits, _ = model.ModelRunner(net).prefill(second, capacity=1024)
    cold = np.asarray(cold_logits)
    assert np.abs(warm - cold).max() / np.abs(cold).max() < 1e-4
    assert warm_token == int(np.argmax(cold))
