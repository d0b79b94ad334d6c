"""Fine-stage indexer scores over candidate key blocks read through a block table.

Reference in plain jnp; the Pallas kernel slots in beside it.
"""

import jax
import jax.numpy as jnp


def gathered_index_scores_reference(q, w, k, block_table, *, block_size, q_offset=0):
    """Scores of query tiles against the key blocks their block table names.

    q: [T, H_I, d_I], w: [T, H_I], k: [L, d_I],
    block_table: i32[n_tiles, n_cand], one row per tile of query_tile = T // n_tiles
        consecutive queries (T must be a multiple of n_tiles; one row per query is the
        untiled case), naming candidate key blocks of block_size tokens (-1 = none).
    Returns f32[T, n_cand * block_size]; column c is token block_table[tile(t), c // B] * B
    + c % B. Entries are -inf where the block id is -1, the token is >= L, or the token is
    in the future of the query (token > q_offset + t).
    """
    T = q.shape[0]
    n_tiles, n_cand = block_table.shape
    if T % n_tiles:
        raise ValueError(f"T={T} must be a multiple of block_table rows={n_tiles}")
    query_tile = T // n_tiles
    L = k.shape[0]
    tokens = block_table[:, :, None] * block_size + jnp.arange(block_size)  # [n_tiles, n_cand, B]
    tokens = tokens.reshape(n_tiles, n_cand * block_size)
    valid = (block_table[:, :, None] >= 0).repeat(block_size, axis=2).reshape(tokens.shape)
    valid &= tokens < L
    k_g = k[jnp.clip(tokens, 0, L - 1)]  # [n_tiles, C, d_I]
    qt = q.reshape(n_tiles, query_tile, *q.shape[1:])
    wt = w.reshape(n_tiles, query_tile, w.shape[1]).astype(jnp.float32)
    logits = jnp.einsum("nthd,ncd->nthc", qt, k_g, preferred_element_type=jnp.float32)
    scores = jnp.einsum("nthc,nth->ntc", jax.nn.relu(logits), wt)
    q_pos = q_offset + jnp.arange(T).reshape(n_tiles, query_tile)
    visible = valid[:, None, :] & (tokens[:, None, :] <= q_pos[:, :, None])
    return jnp.where(visible, scores, -jnp.inf).reshape(T, n_cand * block_size)
