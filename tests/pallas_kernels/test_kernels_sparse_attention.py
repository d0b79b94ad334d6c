"""sparse_attention Pallas kernel (interpret mode) against its jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels.sparse_attention import (
    SparseAttentionConfig,
    sparse_attention_pallas,
    sparse_attention_reference,
)
from tests.pallas_kernels.test_kernels_common import POISON, normal


def qkv(seed, T, L, H, H_kv, D, Dv, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (normal(kq, (T, H, D), dtype), normal(kk, (L, H_kv, D), dtype),
            normal(kv, (L, H_kv, Dv), dtype))


def selector_indices(seed, T, K, L, q_offset=0):
    """Selector format: causal random tokens first, -1 padding last (min(K, t+1) valid)."""
    t = q_offset + jnp.arange(T)[:, None]
    u = jax.random.uniform(jax.random.key(seed), (T, K))
    idx = jnp.minimum((u * (t + 1)).astype(jnp.int32), L - 1)
    return jnp.where(jnp.arange(K)[None, :] <= t, idx, -1)


def check(out, ref, dtype):
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any(), "unwritten/NaN output"
    tol = 2e-5 if dtype == jnp.float32 else 1.6e-2  # bf16 output: about two ulps
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), rtol=tol, atol=tol)


def test_gqa_ragged_dims_scattered_minus_one():
    """GQA, D and Dv not powers of two, K not a chunk multiple, -1 anywhere, one empty row."""
    T, L, K = 7, 50, 37
    q, k, v = qkv(0, T, L, 4, 2, 24, 20)
    idx = jax.random.randint(jax.random.key(1), (T, K), -1, L).at[1].set(-1)
    out = sparse_attention_pallas(q, k, v, idx, config=SparseAttentionConfig(block_k=16),
                                  interpret=True, poison=POISON)
    check(out, sparse_attention_reference(q, k, v, idx), jnp.float32)
    assert not np.asarray(out[1]).any()  # nothing selected -> zeros


@pytest.mark.parametrize("skip_empty", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_selector_format_bf16(skip_empty):
    """Trailing -1 padding (rows with 1..K valid entries and one with none), MQA, bf16."""
    T, L, K = 12, 300, 100
    q, k, v = qkv(2, T, L, 16, 1, 64, 64, jnp.bfloat16)
    idx = selector_indices(3, T, K, L, q_offset=40).at[5].set(-1)
    idx = idx.at[0, :60].set(-1)  # a whole chunk of -1 before valid entries
    cfg = SparseAttentionConfig(block_k=16, skip_empty_chunks=skip_empty)
    out = sparse_attention_pallas(q, k, v, idx, config=cfg, interpret=True, poison=POISON)
    check(out, sparse_attention_reference(q, k, v, idx), jnp.bfloat16)
    assert not np.asarray(out[5], np.float32).any()


def test_head_blocks_scale_and_duplicates():
    """G = 32 query heads per kv head in programs of 16; explicit scale; repeated ids."""
    T, L, K = 5, 40, 24
    q, k, v = qkv(4, T, L, 32, 1, 16, 16)
    idx = jax.random.randint(jax.random.key(5), (T, K), 0, 8)  # many duplicates
    out = sparse_attention_pallas(q, k, v, idx, scale=0.3,
                                  config=SparseAttentionConfig(block_k=16, block_h=16),
                                  interpret=True, poison=POISON)
    check(out, sparse_attention_reference(q, k, v, idx, scale=0.3), jnp.float32)


def test_all_rows_empty():
    q, k, v = qkv(6, 4, 30, 4, 1, 16, 16)
    idx = jnp.full((4, 20), -1, jnp.int32)
    out = sparse_attention_pallas(q, k, v, idx, interpret=True, poison=POISON)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_api_dispatch():
    q, k, v = qkv(7, 6, 30, 4, 2, 16, 16)
    idx = selector_indices(8, 6, 16, 30, q_offset=10)
    xla = pallas_kernels.sparse_attention(q, k, v, idx, backend="xla")
    interp = pallas_kernels.sparse_attention(q, k, v, idx, backend="interpret")
    check(interp, xla, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32,
                                   pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_masked_dense_form_equals_the_gather(dtype):
    """The xla backend's masked form (a large share of the keys selected): same outputs as
    the gathering reference, indices in any order, repeated, -1 anywhere, one empty row."""
    from pallas_kernels.api import MASKED_MIN_SHARE
    from pallas_kernels.sparse_attention import sparse_attention_masked

    T, L, K = 9, 53, 23
    q, k, v = qkv(4, T, L, 6, 2, 24, 20, dtype)
    order = jnp.argsort(jax.random.uniform(jax.random.key(5), (T, L)), axis=1)[:, :K]
    drop = jax.random.uniform(jax.random.key(6), (T, K)) < 0.3
    idx = jnp.where(drop, -1, order).astype(jnp.int32).at[2].set(-1)
    idx = idx.at[4, :5].set(idx[4, 7])  # a repeated token weighs as often as it is read
    ref = sparse_attention_reference(q, k, v, idx)
    check(sparse_attention_masked(q, k, v, idx), ref, dtype)
    assert K >= MASKED_MIN_SHARE * L  # the public entry takes the masked form here
    check(pallas_kernels.sparse_attention(q, k, v, idx, backend="xla"), ref, dtype)
    assert not np.asarray(sparse_attention_masked(q, k, v, idx)[2], np.float32).any()


@pytest.mark.parametrize("K", [6, 23])  # the gathering form, then the masked one (K >= L/4)
def test_xla_backend_attends_in_query_row_chunks(monkeypatch, K):
    """The xla backend's chunks of XLA_ATTENTION_ROWS queries (T not a multiple of them,
    an empty row among them) give the unchunked reference's outputs."""
    from pallas_kernels import api

    T, L = 11, 53
    q, k, v = qkv(9, T, L, 6, 2, 24, 20)
    idx = selector_indices(10, T, K, L, q_offset=L - T).at[5].set(-1)
    ref = sparse_attention_reference(q, k, v, idx)
    monkeypatch.setattr(api, "XLA_ATTENTION_ROWS", 4)
    out = pallas_kernels.sparse_attention(q, k, v, idx, backend="xla")
    assert out.shape == ref.shape
    check(out, ref, jnp.float32)
    assert not np.asarray(out[5]).any()


@pytest.mark.parametrize("dtype", [jnp.float32,
                                   pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("tiles", [(4, 8, 3), (16, 16, 1), (5, 7, 2)])
def test_blocks_form_equals_the_gather(dtype, tiles):
    """The CPU's block-union form ("xla_blocks"): T and L off every tile, rows of one tile
    spread over many blocks (several loop steps) or few, repeated indices, -1 anywhere, an
    empty row; same outputs as the gathering reference."""
    from pallas_kernels.sparse_attention_blocks import BlockTiles

    T, L, K = 13, 61, 9
    q, k, v = qkv(11, T, L, 6, 2, 24, 20, dtype)
    idx = selector_indices(12, T, K, L, q_offset=L - T)
    idx = idx.at[3].set(-1).at[7, :4].set(idx[7, 5]).at[9, ::2].set(-1)
    ref = sparse_attention_reference(q, k, v, idx)
    out = pallas_kernels.OPS["sparse_attention"].implementations["xla_blocks"].run(
        q, k, v, idx, tiles=BlockTiles(*tiles))
    assert out.shape == ref.shape and out.dtype == ref.dtype
    check(out, ref, dtype)
    assert not np.asarray(out[3], np.float32).any()


def test_blocks_form_runs_by_name_and_counts_its_union():
    from pallas_kernels.sparse_attention_blocks import BlockTiles, union_keys

    assert pallas_kernels.resolve("sparse_attention") == "xla"  # CPU: measured, no win
    assert pallas_kernels.resolve("sparse_attention", "xla_blocks") == "xla_blocks"
    with pytest.raises(ValueError, match="BlockTiles.rows must be >= 1"):
        BlockTiles(rows=0)
    # Two rows selecting tokens 0 and 40 with blocks of 32: blocks 0 and 1 for both rows.
    assert list(union_keys(np.array([[0, -1], [40, -1]]), 64, BlockTiles(2, 32, 1))) == [
        64, 64]
