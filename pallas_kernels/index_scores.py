"""Lightning-indexer scores: I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]), causal.

This file holds the plain-jnp reference; the Pallas kernel and its jitted wrapper live
beside it (added with the kernels issue) and must match `index_scores_reference`.
"""

import jax
import jax.numpy as jnp


def index_scores_reference(q, w, k, *, q_offset=0):
    """q: [T, H_I, d_I], w: [T, H_I], k: [L, d_I] -> f32[T, L].

    Query i sits at absolute position q_offset + i, key j at position j; entries with
    j > q_offset + i are -inf. fp32 accumulation whatever the input dtype.
    """
    logits = jnp.einsum("thd,ld->thl", q, k, preferred_element_type=jnp.float32)
    scores = jnp.einsum("thl,th->tl", jax.nn.relu(logits), w.astype(jnp.float32))
    q_pos = q_offset + jnp.arange(q.shape[0])[:, None]
    k_pos = jnp.arange(k.shape[0])[None, :]
    return jnp.where(k_pos <= q_pos, scores, -jnp.inf)
