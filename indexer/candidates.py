"""Candidate-block selection of the hierarchical indexer (pure functions over arrays).

Per query: the forced blocks (sink blocks, and the local blocks ending at the block that
holds the query) first, then the best blocks by coarse score, then `bound_blocks` more by
spread or upper bound (blocks whose pooled mean hides one outstanding token). Per tile of
queries:
the union of its queries' lists, best rank first, capped at a static size; the fine stage
scores the tile's union as one dense product and each query ranks its own blocks in it
(or, with shared candidates, every block of the union).
"""

import jax
import jax.numpy as jnp


def forced_blocks(q_positions, n_blocks, *, block_size, sink_blocks, local_blocks):
    """bool[T, n_blocks]: sink blocks and the local_blocks blocks ending at the block of
    each query, restricted to blocks the query sees (none for padding rows, position -1)."""
    b = jnp.arange(n_blocks)[None, :]
    own = (q_positions // block_size)[:, None]
    seen = (b * block_size <= q_positions[:, None]) & (q_positions[:, None] >= 0)
    return ((b < sink_blocks) | ((b > own - local_blocks) & (b <= own))) & seen


def select_candidate_blocks(scores, q_positions, n_candidates, *, block_size, sink_blocks=1,
                            local_blocks=1, bound_scores=None, bound_blocks=0,
                            keep_ratio=None, keep_blocks=None):
    """Each query's candidate blocks -> i32[T, n_candidates] (-1 = none), in rank order:
    forced blocks, then the best by `scores`, then (last `bound_blocks` slots) the best
    remaining by `bound_scores`.

    scores f32[T, nb]: coarse block scores, -inf where the query does not see the block;
    q_positions i32[T] (-1 = padding row); bound_scores f32[T, nb] or None: per-block upper
    bounds (indexer.exact.block_upper_bounds). keep_ratio: keep only
    ceil(keep_ratio * blocks the query sees) (at least the forced ones). keep_blocks
    i32[T] or None: keep at most this many of the forced and best-scored blocks per query
    (the mass rule, indexer.coarse_screen.mass_budget); the bound slots stay.
    """
    T, nb = scores.shape
    n_candidates = min(n_candidates, nb)
    bound_blocks = min(bound_blocks, n_candidates) if bound_scores is not None else 0
    n_main = n_candidates - bound_blocks
    forced = forced_blocks(q_positions, nb, block_size=block_size, sink_blocks=sink_blocks,
                           local_blocks=local_blocks)
    top, blocks = jax.lax.top_k(jnp.where(forced, jnp.inf, scores), n_main)
    table = jnp.where(top > -jnp.inf, blocks, -1)
    if bound_blocks:
        rows = jnp.arange(T)[:, None]
        taken = jnp.zeros((T, nb), bool).at[rows, jnp.where(table >= 0, table, nb)].set(
            True, mode="drop")
        btop, bblocks = jax.lax.top_k(jnp.where(taken, -jnp.inf, bound_scores), bound_blocks)
        table = jnp.concatenate([table, jnp.where(btop > -jnp.inf, bblocks, -1)], axis=1)
    if keep_blocks is not None:
        slot = jnp.arange(table.shape[1])[None, :]
        table = jnp.where((slot < keep_blocks[:, None]) | (slot >= n_main), table, -1)
    if keep_ratio is not None:
        seen = jnp.where(q_positions >= 0, q_positions // block_size + 1, 0)
        keep = jnp.maximum(jnp.ceil(keep_ratio * seen - 1e-6).astype(jnp.int32),
                           jnp.sum(forced, axis=1))
        table = jnp.where(jnp.arange(table.shape[1])[None, :] < keep[:, None], table, -1)
    return table.astype(jnp.int32)


def candidate_ranks(n_candidates, bound_blocks):
    """Rank of each slot of a select_candidate_blocks row, for the tile union: list
    position, except that the bound slots rank from 1 (they compete with the best
    coarse-ranked blocks instead of coming last)."""
    ranks = jnp.arange(n_candidates)
    n_main = n_candidates - bound_blocks
    return jnp.where(ranks < n_main, ranks, ranks - n_main + 1)


def tile_candidate_union(candidates, query_tile, n_union, *, n_blocks, bound_blocks=0):
    """One block table per tile of query_tile consecutive queries -> i32[T // query_tile,
    n_union]: the union of its queries' candidate lists (select_candidate_blocks), best
    rank first (the smallest rank any query gives the block, then how many queries list
    it), -1 where the union is smaller. When it is larger, the blocks no query ranks high
    are cut. n_blocks: blocks in the context (static).
    """
    T, n_cand = candidates.shape
    if query_tile == 1 and n_union >= n_cand:
        return jnp.pad(candidates, ((0, 0), (0, n_union - n_cand)), constant_values=-1)
    n_tiles = T // query_tile
    ranks = jnp.broadcast_to(candidate_ranks(n_cand, min(bound_blocks, n_cand)), candidates.shape)
    tile = (jnp.arange(T) // query_tile)[:, None]
    idx = jnp.where(candidates >= 0, candidates, n_blocks)  # n_blocks: dropped
    big = jnp.iinfo(jnp.int32).max
    best = jnp.full((n_tiles, n_blocks), big, jnp.int32).at[tile, idx].min(ranks, mode="drop")
    votes = jnp.zeros((n_tiles, n_blocks), jnp.float32).at[tile, idx].add(1.0, mode="drop")
    prio = jnp.where(best < big, votes / (query_tile + 1) - best.astype(jnp.float32), -jnp.inf)
    top, blocks = jax.lax.top_k(prio, min(n_union, n_blocks))
    return jnp.where(top > -jnp.inf, blocks, -1).astype(jnp.int32)


def table_slots(block_table, candidates, query_tile, n_blocks):
    """Slot of each query's candidate blocks in its tile's block table -> i32[T, n_cand]
    (-1 where the block is not in the table or the entry is -1)."""
    n_tiles, n_union = block_table.shape
    tiles = jnp.arange(n_tiles)[:, None]
    slot = jnp.full((n_tiles, n_blocks), -1, jnp.int32).at[
        tiles, jnp.where(block_table >= 0, block_table, n_blocks)].set(
        jnp.broadcast_to(jnp.arange(n_union, dtype=jnp.int32), block_table.shape), mode="drop")
    tile = (jnp.arange(candidates.shape[0]) // query_tile)[:, None]
    found = slot[tile, jnp.clip(candidates, 0, n_blocks - 1)]
    return jnp.where(candidates >= 0, found, -1)


def spread_boosted_scores(coarse, q, w, summaries):
    """Approximate mode's priority for the bound slots, f32[T, n_blocks]: the coarse score
    plus J_t * r_b, the most the block's spread around its mean could add (J_t: see
    joint_factor). Not a bound (the coarse score sums signed heads), but free: it reuses
    the coarse scores, where block_upper_bounds costs three more products. A block holding
    one outstanding token has a large radius and ranks high. Blocks without a radius
    (incomplete) keep their coarse score."""
    radius = summaries.radius[None, :]
    boost = joint_factor(q.astype(jnp.float32), w)[:, None] * radius
    return jnp.where(jnp.isinf(radius), coarse, coarse + boost)


def joint_factor(q, w):
    """J per query (f32[T]): max over unit u of sum_{j: w_j >= 0} w_j ReLU(q_j . u), bounded
    by sqrt(sum_j a_j) * sqrt(max_j sum_k sqrt(a_j a_k) |q^_j . q^_k|), a_j = w_j |q_j|,
    and by sum_j a_j; slightly inflated to cover rounding."""
    norms = jnp.linalg.norm(q, axis=-1)  # [T, H]
    a = jnp.where(w >= 0, w.astype(jnp.float32) * norms, 0.0)
    unit = q / jnp.maximum(norms, 1e-30)[..., None]
    cos = jnp.abs(jnp.einsum("thd,tkd->thk", unit, unit, precision=jax.lax.Precision.HIGHEST))
    ra = jnp.sqrt(a)
    lam = jnp.max(jnp.sum(ra[:, :, None] * ra[:, None, :] * cos, axis=2), axis=1)
    total = jnp.sum(a, axis=1)
    return jnp.minimum(total, jnp.sqrt(total * lam)) * (1 + 1e-5)


def table_tokens(block_table, cols, block_size, query_tile):
    """Token ids of fine-score columns: cols i32[T, K] index the concatenated candidate
    blocks of each row's tile in block_table i32[n_tiles, n_cand]."""
    T = cols.shape[0]
    n_cand = block_table.shape[1]
    tile = (jnp.arange(T) // query_tile)[:, None]
    blocks = block_table[tile, jnp.clip(cols // block_size, 0, n_cand - 1)]
    return blocks * block_size + cols % block_size


def compact_blocks(blocks):
    """The entries >= 0 of each row first, in their order, then the -1s (i32[T, n])."""
    order = jnp.argsort(blocks < 0, axis=1, stable=True)
    return jnp.take_along_axis(blocks, order, axis=1)


def sort_blocks(blocks):
    """Block ids ascending along the last axis, -1 entries last. Fine-stage columns then run
    in token order, so lax.top_k (stable) breaks score ties by the lower token, as flat does."""
    big = jnp.iinfo(jnp.int32).max
    ids = jnp.sort(jnp.where(blocks < 0, big, blocks), axis=-1)
    return jnp.where(ids == big, -1, ids).astype(jnp.int32)
