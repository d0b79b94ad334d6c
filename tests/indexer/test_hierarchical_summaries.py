"""Block summaries: incremental appends equal a recomputation, whatever the append sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.block_summaries import append, block_summaries, empty_summaries, truncate

CAPACITY, DIM = 48, 3
SIZES = (1, 2, 5, 16)  # few distinct shapes: each compiles once


@functools.partial(jax.jit, static_argnames=("block_size",))
def _append(cache, k_new, start, n_valid, keys, *, block_size):
    return append(cache, k_new, start, block_size=block_size, n_valid=n_valid, keys=keys)


def reference(keys, length, block_size):
    """numpy summaries of keys[:length] in blocks of block_size (CAPACITY positions)."""
    nb = -(-CAPACITY // block_size)
    out = dict(sum=np.zeros((nb, DIM)), count=np.zeros(nb, int),
               min=np.full((nb, DIM), np.inf), max=np.full((nb, DIM), -np.inf),
               radius=np.full(nb, np.inf))
    for b in range(nb):
        rows = keys[b * block_size:min((b + 1) * block_size, length)]
        if len(rows):
            out["sum"][b], out["count"][b] = rows.sum(0), len(rows)
            out["min"][b], out["max"][b] = rows.min(0), rows.max(0)
            if len(rows) == block_size:
                out["radius"][b] = np.linalg.norm(rows - rows.mean(0), axis=1).max()
    return out


def assert_matches(cache, want):
    np.testing.assert_array_equal(np.asarray(cache.count), want["count"])
    np.testing.assert_allclose(np.asarray(cache.sum), want["sum"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.min), want["min"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(cache.max), want["max"].astype(np.float32))
    radius = np.asarray(cache.radius)
    np.testing.assert_array_equal(np.isinf(radius), np.isinf(want["radius"]))
    done = np.isfinite(want["radius"])
    # Stored radii are inflated by 1e-5 relative to cover rounding, never smaller.
    assert (radius[done] >= want["radius"][done] * (1 - 1e-6)).all()
    np.testing.assert_allclose(radius[done], want["radius"][done], rtol=3e-5, atol=3e-6)


@settings(max_examples=30, deadline=None)
@given(block_size=st.sampled_from([1, 3, 8]),
       steps=st.lists(st.tuples(st.sampled_from(SIZES), st.integers(0, 16)), min_size=1,
                      max_size=8),
       seed=st.integers(0, 2**16))
@pytest.mark.slow  # a heavy equivalence: default-tier headroom
def test_incremental_summaries_equal_recomputed_ones(block_size, steps, seed):
    """Appends of any sizes (each chunk possibly padded: only n_valid of its rows real), in
    order, leave the same summaries as computing them from the keys at once."""
    keys = np.asarray(jax.random.normal(jax.random.key(seed), (CAPACITY, DIM)), np.float32)
    nb = -(-CAPACITY // block_size)
    cache = empty_summaries(nb, DIM)
    cache_keys = np.zeros((CAPACITY, DIM), np.float32)
    length = 0
    for size, valid in steps:
        n_valid = min(valid, size, CAPACITY - length)
        if length + size > CAPACITY:
            break
        chunk = keys[length:length + size].copy()
        chunk[n_valid:] = 1e6  # padding rows: written to the key cache, not summarised
        cache_keys[length:length + size] = chunk
        cache = _append(cache, jnp.asarray(chunk), jnp.int32(length), jnp.int32(n_valid),
                        jnp.asarray(cache_keys), block_size=block_size)
        length += n_valid
        cache_keys[length:] = 0  # later appends overwrite the padding
    assert_matches(cache, reference(keys, length, block_size))


def test_one_shot_summaries_and_truncate():
    keys = np.asarray(jax.random.normal(jax.random.key(1), (CAPACITY, DIM)), np.float32)
    for length in (0, 7, 8, 30, CAPACITY):
        assert_matches(block_summaries(jnp.asarray(keys), 8, length=length),
                       reference(keys, length, 8))
    full = block_summaries(jnp.asarray(keys), 8)
    for length in (0, 5, 16, 29):
        assert_matches(truncate(full, jnp.asarray(keys), length, block_size=8),
                       reference(keys, length, 8))


def test_decode_append_touches_one_block():
    cache = block_summaries(jnp.zeros((16, DIM)), 4, length=5)
    new = append(cache, jnp.ones((1, DIM)), 5, block_size=4)
    changed = [b for b in range(4) if not np.array_equal(np.asarray(new.sum[b]),
                                                         np.asarray(cache.sum[b]))]
    assert changed == [1] and int(new.count[1]) == 2
