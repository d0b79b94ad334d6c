"""Attention over each query's selected tokens (DSA main attention).

Reference in plain jnp; the Pallas kernel slots in beside it.
"""

import jax
import jax.numpy as jnp


def sparse_attention_reference(q, k, v, indices, *, scale=None):
    """q: [T, H, D], k: [L, H_kv, D], v: [L, H_kv, Dv], indices: i32[T, K] -> [T, H, Dv].

    Every head of query t attends to the tokens indices[t] (shared across heads, GQA:
    head h reads kv head h // (H // H_kv)); -1 entries are never attended. A row with no
    valid index returns zeros. Softmax in fp32; output in q's dtype.
    """
    T, H, D = q.shape
    H_kv = k.shape[1]
    if H % H_kv:
        raise ValueError(f"number of query heads H={H} must be a multiple of H_kv={H_kv}")
    scale = D**-0.5 if scale is None else scale
    valid = indices >= 0
    safe = jnp.where(valid, indices, 0)
    k_sel = k[safe]  # [T, K, H_kv, D]
    v_sel = v[safe]  # [T, K, H_kv, Dv]
    qg = q.reshape(T, H_kv, H // H_kv, D)
    logits = jnp.einsum("tgrd,tkgd->tgrk", qg, k_sel, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tgrk,tkgd->tgrd", p, v_sel.astype(jnp.float32))
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(T, H, v.shape[-1]).astype(q.dtype)
