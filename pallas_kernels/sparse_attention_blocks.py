"""Sparse attention as dense-rate math over the key blocks a tile of queries selected
(the CPU implementation "xla_blocks" of pallas_kernels.api.sparse_attention).

Gathering each query's own K rows ([T, top_k, H_kv, D]: 1.5 MB per SmolLM2 query and layer
at top_k 1024) makes the reference a memory-bound gather plus batched matrix-vector
products: ~13 GFLOP/s on a 2-core CPU whose f32 matmul runs at ~90 (docs/results.md).
Neighbouring queries select largely the same tokens, so here a tile of `rows` queries
attends to the union of the `block`-token key blocks any of its rows selected, `steps`
blocks at a time: each step gathers those blocks once for the whole tile and runs two
matrix products ([rows x heads per kv head, D] x [D, steps x block] and back), with a
per-row weight, how often the row selected each key (0: masked out; a repeated index
counts as often as the reference's gather reads it), and a flash-style online softmax in
f32. The loop runs as many steps as the tile's union needs (a while loop: no static bound,
no overflow), so the work is the union's size, not the context's.

`sparse_attention_blocks_reference` is not needed: the reference is
pallas_kernels.sparse_attention.sparse_attention_reference, which this must match.
"""

import dataclasses

import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True, slots=True)
class BlockTiles:
    """rows: queries per tile (sharing one union of blocks); block: keys per block; steps:
    blocks gathered per loop step. Defaults measured on a 2-core CPU with SmolLM2's
    selections (docs/results.md, "Sparse prefill at the machine's limit")."""

    rows: int = 64
    block: int = 32
    steps: int = 8

    def __post_init__(self):
        for name in ("rows", "block", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockTiles.{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_TILES = BlockTiles()


def selection_counts(indices, n_keys):
    """indices i32[R, K] (-1: none) -> f32[R, n_keys]: how often row r selected key j."""
    valid = indices >= 0
    rows = jnp.broadcast_to(jnp.arange(indices.shape[0])[:, None], indices.shape)
    return jnp.zeros((indices.shape[0], n_keys), jnp.float32).at[
        rows, jnp.where(valid, indices, 0)].add(valid.astype(jnp.float32))


def sparse_attention_blocks(q, k, v, indices, *, scale=None, tiles=DEFAULT_TILES):
    """One tile: q [R, H, D], k [L, H_kv, D], v [L, H_kv, Dv], indices i32[R, K] ->
    [R, H, Dv], equal to sparse_attention_reference (every row of q is one tile: the caller
    maps this over tiles of tiles.rows queries, pallas_kernels.api)."""
    R, H, D = q.shape
    L, H_kv = k.shape[:2]
    Dv = v.shape[-1]
    if H % H_kv:
        raise ValueError(f"number of query heads H={H} must be a multiple of H_kv={H_kv}")
    scale = D**-0.5 if scale is None else scale
    B, G, r = tiles.block, tiles.steps, H // H_kv
    nb = -(-L // B)

    def by_head(x):  # [L, H_kv, d] -> [H_kv, nb, B, d]: a block gather is one slice per head
        x = jnp.pad(x.astype(jnp.float32), [(0, nb * B - L), (0, 0), (0, 0)])
        return x.reshape(nb, B, H_kv, x.shape[-1]).transpose(2, 0, 1, 3)

    kb, vb = by_head(k), by_head(v)
    counts = selection_counts(indices, nb * B).reshape(R, nb, B)
    # log(count) added to the logits: exp(logit + log c) = c exp(logit), and log 0 = -inf
    # masks what the row did not select, in one add.
    log_weight = jnp.log(counts)
    used = jnp.max(counts, axis=(0, 2)) > 0
    n_used = jnp.sum(used, dtype=jnp.int32)
    # Padded by G so a step's dynamic_slice never runs past the end.
    blocks = jnp.nonzero(used, size=nb + G, fill_value=0)[0].astype(jnp.int32)
    qh = (q.astype(jnp.float32) * scale).reshape(R, H_kv, r, D).transpose(1, 0, 2, 3)
    qh = qh.reshape(H_kv, R * r, D)

    def step(state):
        s, m, denom, acc = state
        ids = lax.dynamic_slice(blocks, (s * G,), (G,))
        live = (s * G + jnp.arange(G)) < n_used
        bias = jnp.where(live[None, :, None], log_weight[:, ids, :], -jnp.inf)
        keys = kb[:, ids].reshape(H_kv, G * B, D)
        values = vb[:, ids].reshape(H_kv, G * B, Dv)
        logits = jnp.einsum("gqd,gkd->gqk", qh, keys, preferred_element_type=jnp.float32)
        logits = logits.reshape(H_kv, R, r, G * B) + bias.reshape(1, R, 1, G * B)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(logits - m_safe[..., None])
        rescale = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        denom = denom * rescale + jnp.sum(p, axis=-1)
        pv = jnp.einsum("gqk,gkd->gqd", p.reshape(H_kv, R * r, G * B), values,
                        preferred_element_type=jnp.float32)
        acc = acc * rescale[..., None] + pv.reshape(H_kv, R, r, Dv)
        return s + 1, m_new, denom, acc

    shape = (H_kv, R, r)
    state = (jnp.int32(0), jnp.full(shape, -jnp.inf, jnp.float32),
             jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, Dv), jnp.float32))
    _, _, denom, acc = lax.while_loop(lambda st: st[0] * G < n_used, step, state)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.transpose(1, 0, 2, 3).reshape(R, H, Dv).astype(q.dtype)


def union_keys(indices, n_keys, tiles=DEFAULT_TILES):
    """The keys a tiling attends per row of `indices` (i32[T, K]), as numpy: for each tile
    of tiles.rows rows, its union of selected blocks x block (what sparse_attention_blocks
    computes over), divided among its rows. For the study's achieved-rate accounting and
    the tile-size measurements."""
    import numpy as np

    indices = np.asarray(indices)
    T = indices.shape[0]
    out = np.empty(T, np.float64)
    for first in range(0, T, tiles.rows):
        tile = indices[first:first + tiles.rows]
        blocks = np.unique(tile[tile >= 0] // tiles.block)
        out[first:first + tiles.rows] = blocks.size * tiles.block
    return out
