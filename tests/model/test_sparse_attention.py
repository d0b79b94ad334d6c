import jax
import numpy as np
import pytest

import pallas_kernels
from model.attention import dense_causal_attention


def _qkv(seed, T, L, H=4, H_kv=2, D=16):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (T, H, D)), jax.random.normal(kk, (L, H_kv, D)),
            jax.random.normal(kv, (L, H_kv, D)))


@pytest.mark.parametrize("T,L,q_offset", [(19, 19, 0), (7, 40, 33)])
def test_sparse_with_all_visible_tokens_equals_dense(T, L, q_offset):
    q, k, v = _qkv(T * L, T, L)
    pos = q_offset + np.arange(T)
    idx = np.where(np.arange(L)[None, :] <= pos[:, None], np.arange(L)[None, :], -1)
    idx = np.asarray(jax.random.permutation(jax.random.key(1), idx, axis=1, independent=True))
    got = pallas_kernels.sparse_attention(q, k, v, idx.astype(np.int32), backend="xla")
    want = dense_causal_attention(q, k, v, q_offset=q_offset)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_ignores_minus_one_and_gives_zeros_for_empty_rows():
    q, k, v = _qkv(3, 4, 12)
    idx = np.array([[0, 3, -1, -1], [-1, -1, -1, -1], [5, -1, 5, -1], [11, 10, 9, 8]], np.int32)
    out = np.asarray(pallas_kernels.sparse_attention(q, k, v, idx, backend="xla"))
    assert np.all(out[1] == 0)
    # A row selecting one token (twice) returns that token's value for every head.
    np.testing.assert_allclose(out[2], np.repeat(np.asarray(v)[5], 2, axis=0), rtol=1e-6)
    # -1 entries change nothing versus dropping them.
    ref = pallas_kernels.sparse_attention(q[:1], k, v, idx[:1, :2], backend="xla")
    np.testing.assert_allclose(out[:1], ref, rtol=1e-6)
