"""The paged cache (model.paged_cache) against today's contiguous decode slots: the same
prompts prefilled into contiguous caches, their pages scattered over a pool in a shuffled
order with garbage in the scratch page, then decoded by both: equal tokens and logits, and
no page but the requests' own is written."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model
from model import paged_cache
from model.paged_cache import EMPTY, RESERVED_PAGES, SCRATCH
from model.runner import ModelRunner

P = 16  # page tokens: a multiple of tiny's 8-position key blocks
CAPACITY = 128
FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "deepseek_v4" / "tiny"


def _poison(pool, page, config, P):
    """The pool with page `page` of every growing field full of garbage (never read)."""
    out = []
    for stack in pool:  # arrays [layers of the stack, rows, ...]
        fields = {}
        for name, array in stack.fields.items():
            if paged_cache.field(name).is_state:
                fields[name] = array
                continue
            rpp = paged_cache.rows_per_page(name, P, config)
            junk = jnp.full((array.shape[0], rpp, *array.shape[2:]), 7, array.dtype)
            fields[name] = array.at[:, page * rpp:(page + 1) * rpp].set(junk)
        out.append(stack.replace(**fields))
    return out


def _paged_vs_slots(net, prompts, steps, P=P, CAPACITY=CAPACITY):
    config = net.config
    runner = ModelRunner(net)
    rng = np.random.default_rng(0)
    n_slots, width = len(prompts), CAPACITY // P
    n_pages = RESERVED_PAGES + n_slots * width
    pool = paged_cache.init_pool(config, n_pages, P, n_slots)
    pool = _poison(pool, SCRATCH, config, P)
    order = rng.permutation(np.arange(RESERVED_PAGES, n_pages))
    tables = np.full((n_slots + 1, width), EMPTY, np.int32)
    tables[-1] = SCRATCH  # an idle batch row
    slots = runner.new_batch_cache(n_slots, CAPACITY)
    tokens, positions = [], []
    for i, prompt in enumerate(prompts):
        logits, cache = runner.prefill(prompt, capacity=CAPACITY)
        need = -(-(len(prompt) + steps) // P)
        tables[i, :need] = order[i * width:i * width + need]
        ids = np.full(width, SCRATCH, np.int32)
        ids[:need] = tables[i, :need]
        pool = jax.jit(paged_cache.write_pages, static_argnums=(4, 5))(
            pool, cache, jnp.asarray(ids), i, P, config)
        slots = jax.tree.map(lambda s, c, i=i: s.at[i].set(c), slots, cache)
        tokens.append(int(jnp.argmax(logits)))
        positions.append(len(prompt))
    before = jax.tree.map(np.asarray, pool)
    paged_tokens = list(tokens) + [0]
    state_rows = np.arange(n_slots + 1, dtype=np.int32)
    for step in range(steps):
        pos = np.array(positions) + step
        want_logits, slots = runner.decode_batch(np.array(tokens), slots, pos)
        got_logits, pool = runner.decode_paged(np.array(paged_tokens), pool, tables,
                                               np.append(pos, 0), state_rows, page_tokens=P)
        np.testing.assert_allclose(np.asarray(got_logits)[:n_slots], np.asarray(want_logits),
                                   rtol=2e-5, atol=2e-5)
        tokens = [int(t) for t in jnp.argmax(want_logits, -1)]
        paged_tokens = [int(t) for t in jnp.argmax(got_logits, -1)]
        assert paged_tokens[:n_slots] == tokens
    # Only the requests' own pages (and scratch) changed; EMPTY and unused pages did not.
    own = set(tables[:n_slots].ravel().tolist()) - {EMPTY}
    for stack_before, stack_after in zip(before, pool):
        for name, array in stack_after.fields.items():
            if paged_cache.field(name).is_state:
                continue
            differs = np.asarray(array) != stack_before.fields[name]  # [layers, rows, ...]
            changed = np.flatnonzero(np.any(
                np.moveaxis(differs, 1, 0).reshape(n_pages, -1), axis=1))
            assert set(changed.tolist()) <= own | {SCRATCH}, name


# 7-17 s each (their own programs): slow; the default tier's paged check is
# tests/serving/test_paged_engine.py (served outputs equal to generation)
@pytest.mark.slow
@pytest.mark.parametrize("indexer", ["flat", "hierarchical", "streaming", "oracle"])
def test_paged_decode_equals_contiguous_slots(indexer):
    config = model.get_config("tiny").replace(indexer=indexer)
    net = model.Transformer(config, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n) for n in (37, 5, 70)]
    _paged_vs_slots(net, prompts, steps=6)


@pytest.mark.slow  # 34 s: the V4 fixture's prefill and decode programs, twice
def test_paged_decode_of_deepseek_v4_keeps_its_rings_per_request():
    from model.pretrained.registry import load_pretrained
    net = load_pretrained(FIXTURE).model
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, net.config.vocab_size, n) for n in (21, 40)]
    # V4's compressed entries: one per 4 and 16 positions, their summaries per 256
    _paged_vs_slots(net, prompts, steps=5, P=256, CAPACITY=512)


def test_bad_page_sizes_name_the_setting():
    config = model.get_config("tiny")
    with pytest.raises(ValueError, match="cache_block_tokens .12. must be a multiple of 8"):
        paged_cache.check_page_tokens(config, 12, 128)
    with pytest.raises(ValueError, match="must divide the cache capacity"):
        paged_cache.check_page_tokens(config, 48, 128)
