"""gathered_index_scores Pallas kernel (interpret mode) against its jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from pallas_kernels.gathered_index_scores import (
    GatheredScoresConfig,
    gathered_index_scores_pallas,
    gathered_index_scores_reference,
)
from tests.pallas_kernels.test_kernels_common import POISON, assert_scores_match, indexer_inputs


def random_table(seed, n_tiles, n_cand, L, B):
    """Block ids from -1 (none) up to one past the last block (out of range -> -inf)."""
    n_blocks = -(-L // B)
    return jax.random.randint(jax.random.key(seed), (n_tiles, n_cand), -1, n_blocks + 1)


# (seed, T, n_tiles, n_cand, B, L, q_offset, dtype, config)
CASES = [
    # query tile 24 (padded to 32), 2 blocks of 8 per 16-column program, partial last block
    pytest.param(0, 96, 4, 5, 8, 150, 0, jnp.float32, GatheredScoresConfig(16, 16),
                 id="tiles-of-24-B8"),
    # one table row per query (the untiled case)
    pytest.param(1, 40, 40, 3, 16, 70, 10, jnp.float32, GatheredScoresConfig(16, 32),
                 id="row-per-query"),
    # blocks larger than the column tile: each program reads a slice of one block
    pytest.param(2, 64, 2, 3, 64, 200, 100, jnp.bfloat16, GatheredScoresConfig(32, 32),
                 id="B64-slices-bf16"),
    pytest.param(3, 128, 2, 6, 64, 1000, 700, jnp.float32, None, id="default-config",
                 marks=pytest.mark.slow),  # default-tier budget
]


@pytest.mark.parametrize("seed,T,n_tiles,n_cand,B,L,q_offset,dtype,config", CASES)
def test_matches_reference(seed, T, n_tiles, n_cand, B, L, q_offset, dtype, config):
    q, w, k = indexer_inputs(seed, T, L, 3, 24, dtype)
    bt = random_table(seed + 100, n_tiles, n_cand, L, B)
    if q_offset:  # make sure some candidate blocks are visible to the first tile
        bt = bt.at[0, 0].set(0)
    kw = {} if config is None else {"config": config}
    out = gathered_index_scores_pallas(q, w, k, bt, q_offset, block_size=B,
                                       interpret=True, poison=POISON, **kw)
    ref = gathered_index_scores_reference(q, w, k, bt, block_size=B, q_offset=q_offset)
    tol = 1e-5 if dtype == jnp.float32 else 1e-4
    frac = assert_scores_match(out, ref, rtol=tol, atol=tol)
    assert 0 < frac < 1


def test_empty_and_future_rows():
    """A tile with no candidates and a tile whose candidates are all in its future."""
    q, w, k = indexer_inputs(4, 32, 128, 2, 16)
    bt = jnp.array([[-1, -1, -1], [7, 6, 0]], jnp.int32)  # tile 1 sees only block 0
    out = gathered_index_scores_pallas(q, w, k, bt, 0, block_size=16,
                                       config=GatheredScoresConfig(16, 16), interpret=True,
                                       poison=POISON)
    ref = gathered_index_scores_reference(q, w, k, bt, block_size=16)
    assert_scores_match(out, ref)
    assert np.isneginf(np.asarray(out)[:16]).all()


def test_api_dispatch_and_traced_offset():
    q, w, k = indexer_inputs(5, 32, 100, 2, 16)
    bt = random_table(6, 2, 4, 100, 16)
    f = jax.jit(lambda off: pallas_kernels.gathered_index_scores(
        q, w, k, bt, block_size=16, q_offset=off, backend="interpret"))
    for off in (0, 40):
        xla = pallas_kernels.gathered_index_scores(q, w, k, bt, block_size=16, q_offset=off,
                                                   backend="xla")
        assert_scores_match(f(jnp.int32(off)), xla)


def test_block_size_must_be_power_of_two():
    q, w, k = indexer_inputs(7, 16, 40, 2, 16)
    bt = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="power of two"):
        gathered_index_scores_pallas(q, w, k, bt, block_size=12, interpret=True)


def test_tpu_interpreter_bounds_checked():
    """Under the TPU interpreter an out-of-range key read raises, so this proves every
    block slice stays inside k (L = 44 is not a multiple of B = 8; ids run past the end)."""
    q, w, k = indexer_inputs(8, 32, 44, 2, 16)
    bt = jnp.array([[0, 5, 2], [5, 6, 1]], jnp.int32)
    out = gathered_index_scores_pallas(q, w, k, bt, 12, block_size=8,
                                       config=GatheredScoresConfig(16, 16),
                                       interpret=pltpu.InterpretParams(), poison=POISON)
    ref = gathered_index_scores_reference(q, w, k, bt, block_size=8, q_offset=12)
    assert_scores_match(out, ref)
