"""Dense attention in chunks of query rows (model.attention.DENSE_ATTENTION_ROWS on the xla
backend) equals one pass over all rows: outputs, the head-summed target and its rows."""

import jax
import jax.numpy as jnp
import numpy as np

from model import attention


def _inputs(T=13, L=40, H=6, H_kv=2, D=8):
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(kq, (T, H, D)), jax.random.normal(kk, (L, H_kv, D)),
            jax.random.normal(kv, (L, H_kv, D)))


def test_row_chunks_equal_one_pass(monkeypatch):
    q, k, v = _inputs()
    rows = jnp.array([0, 5, 12, 7])
    whole = attention.dense_causal_attention(q, k, v, q_offset=27, return_head_sum=True)
    whole_rows = attention.dense_causal_attention(q, k, v, q_offset=27, return_head_sum=True,
                                                  head_sum_rows=rows)
    monkeypatch.setattr(attention, "DENSE_ATTENTION_ROWS", 4)  # 13 rows: 4 chunks, 3 padded
    out, p = attention.dense_causal_attention(q, k, v, q_offset=27, return_head_sum=True)
    np.testing.assert_allclose(out, whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p, whole[1], rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(p)[0, 28:] == 0)  # causal: query 0 sits at position 27
    _, p_rows = attention.dense_causal_attention(q, k, v, q_offset=27, return_head_sum=True,
                                                 head_sum_rows=rows)
    np.testing.assert_allclose(p_rows, whole_rows[1], rtol=1e-5, atol=1e-7)
    plain = attention.dense_causal_attention(q, k, v, q_offset=27)
    np.testing.assert_allclose(plain, whole[0], rtol=1e-5, atol=1e-6)
