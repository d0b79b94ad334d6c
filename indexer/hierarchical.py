"""Hierarchical (coarse-to-fine) lightning indexer: HISA-style block selection.

Steps, each a pure function over arrays:
  1. block summaries of the keys (indexer.block_summaries): pooled mean, min, max per block;
  2. `coarse_block_scores`: I[t, b] against the pooled keys (optionally fewer heads);
  3. `select_candidate_blocks` (indexer.candidates): per query, sink and local blocks
     always, then the best blocks by coarse score up to a budget (and a few by spread,
     `bound_blocks`); `tile_candidate_union` merges the lists of a tile of queries into one
     block table, so the fine stage is one dense product per tile;
  4. `fine_topk`: exact scores of the table's tokens (pallas_kernels.gathered_index_scores,
     causal), each query ranking its own candidates, top_k in the format of `flat_topk`;
  5. exact mode (indexer.exact): per-block upper bounds and refinement rounds until the
     result equals flat top_k.
`hierarchical_topk` runs them over chunks of `fine_batch_size` queries (lax.map), so memory
is O(fine_batch_size * (L / block_size + candidates)), never [T, L].
"""

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from indexer.block_summaries import (
    block_means,
    block_summaries,
    slice_blocks,
    visible_blocks,
)
from indexer.candidates import (
    compact_blocks,
    forced_blocks,
    select_candidate_blocks,
    sort_blocks,
    spread_boosted_scores,
    table_slots,
    table_tokens,
    tile_candidate_union,
)
from indexer.coarse_screen import mass_budget, screen_block_scores
from indexer.config import HierarchicalConfig, hierarchical_plan
from indexer.exact import block_upper_bounds, refine_exact
from indexer.scoring import check_key_ratio, last_visible_key, threshold_topk

__all__ = ["coarse_block_scores", "fine_topk", "hierarchical_topk",
           "hierarchical_topk_with_stats", "select_candidate_blocks"]


def _positions(n, q_offset, q_positions):
    return q_offset + jnp.arange(n) if q_positions is None else q_positions


def coarse_block_scores(q, w, summaries, *, block_size, q_offset=0, q_positions=None,
                        coarse_heads=None, head_select="max_abs_weight", backend=None):
    """Block scores f32[T, n_blocks]: sum_j w_j ReLU(q_j . mean_b) over the coarse heads.

    q [T, H_I, d_I], w [T, H_I], summaries: BlockSummaryCache of the keys. A block is
    visible to a query iff it is non-empty and its first token is at or before the query
    (the block holding the query is visible); others are -inf. q_positions i32[T]: the
    rows' positions when some are padding (-1); the others must be q_offset + row.
    coarse_heads: use only that many heads per query, the largest |w| ("max_abs_weight")
    or the first ones ("first").
    """
    T, H, _ = q.shape
    if coarse_heads is not None and coarse_heads < H:
        if head_select == "first":
            q, w = q[:, :coarse_heads], w[:, :coarse_heads]
        else:
            _, heads = jax.lax.top_k(jnp.abs(w), coarse_heads)
            q = jnp.take_along_axis(q, heads[:, :, None], axis=1)
            w = jnp.take_along_axis(w, heads, axis=1)
    means = block_means(summaries).astype(q.dtype)
    # Block-causal in the kernel (it skips tiles of blocks after every query of a tile);
    # empty blocks and padding rows (q_positions -1) are masked here.
    scores = pallas_kernels.index_scores(q, w, means, q_offset=q_offset,
                                         key_block_size=block_size, backend=backend)
    visible = visible_blocks(_positions(T, q_offset, q_positions), summaries, block_size)
    return jnp.where(visible, scores, -jnp.inf)


def fine_topk(q, w, k, block_table, top_k, *, block_size, q_offset=0, candidates=None,
              slots=None, fast_ranking=False, q_positions=None, backend=None):
    """Exact scores inside the candidate blocks, causal, then top_k.

    block_table i32[n_tiles, n_union]: blocks scored for each tile of T // n_tiles queries,
    as one dense product (pallas_kernels.gathered_index_scores). candidates i32[T, n_cand]
    with slots i32[T, n_cand] (candidates.table_slots): rank each query only over its own
    candidate blocks found in its tile's table; None: over every block of the table.
    fast_ranking: rank with threshold_topk (near-ties either way; not best first) instead
    of lax.top_k (best first). q_positions i32[T]: each row's last visible key, when
    it is below q_offset + row (keys that summarise several positions: the kernel's causality
    is then a superset, narrowed here). Returns (values f32[T, top_k], tokens
    i32[T, top_k]), -inf / -1 in the last slots where fewer than top_k candidate tokens
    are visible.
    """
    scores = pallas_kernels.gathered_index_scores(
        q, w, k, block_table, block_size=block_size, q_offset=q_offset, backend=backend)
    T = scores.shape[0]
    query_tile = T // block_table.shape[0]
    if candidates is not None:
        n_cand = candidates.shape[1]
        cols = (jnp.maximum(slots, 0)[:, :, None] * block_size + jnp.arange(block_size))
        own = jnp.take_along_axis(scores, cols.reshape(T, n_cand * block_size), axis=1)
        scores = jnp.where(jnp.repeat(slots >= 0, block_size, axis=1), own, -jnp.inf)
        block_table, query_tile = candidates, 1
    C = scores.shape[1]
    if q_positions is not None:
        cols = jnp.broadcast_to(jnp.arange(C)[None, :], (T, C))
        col_keys = table_tokens(block_table, cols, block_size, query_tile)
        scores = jnp.where(col_keys <= q_positions[:, None], scores, -jnp.inf)
    if C < top_k:
        scores = jnp.pad(scores, ((0, 0), (0, top_k - C)), constant_values=-jnp.inf)
    if not fast_ranking:
        values, cols = jax.lax.top_k(scores, top_k)
    else:
        values, cols = threshold_topk(scores, top_k)
    tokens = table_tokens(block_table, cols, block_size, query_tile)
    return values, jnp.where(values > -jnp.inf, tokens, -1).astype(jnp.int32)


def hierarchical_topk_with_stats(q, w, k, top_k, config=HierarchicalConfig(), *, q_offset=0,
                                 summaries=None, screen=None, backend=None, key_ratio=1):
    """`hierarchical_topk` plus statistics of the work done.

    Returns (indices i32[T, top_k], stats), stats a dict of scalars: scored_fraction
    (blocks scored exactly for a query / blocks it sees, summed over queries),
    rescored_fraction (the part scored by exact-mode refinement), rounds (most refinement
    rounds of any query chunk), candidate_blocks and union_blocks (static sizes: the
    maximum), kept_blocks (candidate blocks per query on average: below candidate_blocks
    under the mass rule) and run_blocks (the candidate blocks of the bucket each chunk ran
    at, averaged over chunks: what the fine stage cost).
    """
    return _hierarchical(q, w, k, top_k, config, q_offset=q_offset, summaries=summaries,
                         screen=screen, backend=backend, with_stats=True, key_ratio=key_ratio)


def _coarse(qc, wc, summaries, screen, config, *, start, pos, backend):
    if config.coarse == "learned":
        return screen_block_scores(qc, wc, screen.scales, summaries,
                                   block_size=config.block_size, q_offset=start,
                                   q_positions=pos, backend=backend)
    return coarse_block_scores(qc, wc, summaries, block_size=config.block_size, q_offset=start,
                               q_positions=pos, coarse_heads=config.coarse_heads,
                               head_select=config.coarse_head_select, backend=backend)


def _mass_temperature(config, screen):
    if config.coarse_temperature is not None:
        return jnp.float32(config.coarse_temperature)
    if screen is None:
        return jnp.float32(1.0)
    log_t = screen.log_temperature if config.coarse == "learned" else screen.mean_log_temperature
    return jnp.exp(log_t)


@functools.partial(jax.jit, static_argnames=("top_k", "config", "backend", "with_stats",
                                             "key_ratio"))
def _hierarchical(q, w, k, top_k, config, *, q_offset, summaries, screen, backend, with_stats,
                  key_ratio):
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    check_key_ratio(key_ratio)
    if key_ratio > 1 and config.exact:
        raise ValueError("HierarchicalConfig.exact is not available over keys that summarise "
                         f"several positions (key_ratio {key_ratio}); set exact=False")
    if not isinstance(config, HierarchicalConfig):
        raise TypeError(f"config must be a HierarchicalConfig, got {type(config).__name__}")
    if config.coarse == "learned" and screen is None:
        raise ValueError("HierarchicalConfig.coarse='learned' needs the layer's trained screen "
                         "(screen=ScreenParams; the model passes its CoarseScreen)")
    T, H, _ = q.shape
    B = config.block_size
    plan = hierarchical_plan(config, T, k.shape[0], top_k, H)
    nb, tile, chunk = plan.n_blocks, plan.tile, plan.chunk
    if summaries is None:
        summaries = block_summaries(k, B)
    elif summaries.count.shape[0] < nb:
        raise ValueError(f"summaries hold {summaries.count.shape[0]} blocks, keys need {nb}")
    summaries = slice_blocks(summaries, nb)
    pad = plan.n_chunks * chunk - T
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(plan.n_chunks, chunk, *q.shape[1:])
    wp = jnp.pad(w, ((0, pad), (0, 0))).reshape(plan.n_chunks, chunk, H)
    rows = jnp.arange(plan.n_chunks * chunk).reshape(plan.n_chunks, chunk)
    bound_blocks = min(config.bound_blocks, plan.n_cand)
    need_scored = with_stats or config.exact

    # In key units: a row's position is the last key it sees (its own position when each
    # key is one token), and `start` bounds every row's from above (row 0's, plus the row),
    # which is all the kernels' causality needs; `pos` narrows it.
    narrow = key_ratio > 1

    def fine_stage(qc, wc, cands, start, pos, n_cand, n_union):
        """Fine top-k of a chunk over the first n_cand candidates of each query ->
        (values, tokens, scored bool[chunk, nb] or None: blocks scored for each query)."""
        cands = cands[:, :n_cand]
        table = sort_blocks(tile_candidate_union(cands, tile, n_union, n_blocks=nb,
                                                 bound_blocks=min(bound_blocks, n_cand)))
        cands = sort_blocks(cands)  # token order: ties go to the lower token, as in flat
        slots = table_slots(table, cands, tile, nb) if plan.own else None
        values, tokens = fine_topk(
            qc, wc, k, table, top_k, block_size=B, q_offset=start,
            candidates=cands if plan.own else None, slots=slots,
            fast_ranking=config.fast_ranking and not config.exact,
            q_positions=pos if narrow else None, backend=backend)
        if not need_scored:
            return values, tokens, jnp.zeros((chunk, nb), bool)
        # Blocks scored exactly for each query: its own candidates found in the table, or
        # the whole table of its tile.
        rows_ = jnp.arange(chunk)[:, None]
        listed = jnp.where(slots >= 0, cands, nb) if plan.own else table[rows_[:, 0] // tile]
        listed = jnp.where(listed >= 0, listed, nb)
        scored = jnp.zeros((chunk, nb), bool).at[rows_, listed].set(True, mode="drop")
        return values, tokens, scored

    def one_chunk(args):
        qc, wc, r = args
        pos = jnp.where(r < T, last_visible_key(q_offset + r, key_ratio), -1)
        start = last_visible_key(q_offset + r[0], key_ratio)
        coarse = _coarse(qc, wc, summaries, screen, config, start=start, pos=pos,
                         backend=backend)
        bounds = (block_upper_bounds(qc, wc, summaries, block_size=B, q_positions=pos,
                                     backend=backend) if config.exact else None)
        if bound_blocks and not config.exact:
            bounds = spread_boosted_scores(coarse, qc, wc, summaries)
        keep = None
        if plan.buckets:
            forced = forced_blocks(pos, nb, block_size=B, sink_blocks=config.sink_blocks,
                                   local_blocks=config.local_blocks)
            keep = mass_budget(coarse, _mass_temperature(config, screen), config.coarse_mass,
                               forced)
        cands = select_candidate_blocks(
            coarse, pos, plan.n_cand, block_size=B, sink_blocks=config.sink_blocks,
            local_blocks=config.local_blocks, bound_scores=bounds if bound_blocks else None,
            bound_blocks=bound_blocks, keep_ratio=config.coarse_keep_ratio, keep_blocks=keep)
        kept = jnp.sum((cands >= 0) & (pos >= 0)[:, None])
        run = plan.n_cand
        if plan.buckets:
            # The chunk runs at the smallest bucket that holds every query's kept blocks.
            cands = compact_blocks(cands)
            sizes = jnp.asarray([m for m, _ in plan.buckets])
            need = jnp.max(jnp.sum(cands >= 0, axis=1))
            branch = jnp.minimum(jnp.sum(sizes < need), len(plan.buckets) - 1)
            values, tokens, scored = jax.lax.switch(
                branch, [functools.partial(fine_stage, n_cand=m, n_union=u)
                         for m, u in plan.buckets], qc, wc, cands, start, pos)
            run = sizes[branch]
        else:
            values, tokens, scored = fine_stage(qc, wc, cands, start, pos, plan.n_cand,
                                                plan.n_union)
        if not need_scored:
            return jnp.where(values > -jnp.inf, tokens, -1), jnp.zeros(5, jnp.int32), 0
        seen = visible_blocks(pos, summaries, B)
        n_initial = jnp.sum(scored & seen)
        rounds = jnp.int32(0)
        if config.exact:
            values, tokens, scored, rounds = refine_exact(
                qc, wc, k, bounds, values, tokens, scored, q_offset=start, block_size=B,
                query_tile=tile, refine_blocks=config.refine_blocks, backend=backend)
        tokens = jnp.where(values > -jnp.inf, tokens, -1).astype(jnp.int32)
        counts = jnp.stack([n_initial, jnp.sum(scored & seen), jnp.sum(seen), kept,
                            jnp.int32(run)]).astype(jnp.int32)
        return tokens, counts, rounds

    tokens, counts, rounds = jax.lax.map(one_chunk, (qp, wp, rows))
    tokens = tokens.reshape(plan.n_chunks * chunk, top_k)[:T]
    if not with_stats:
        return tokens
    initial, scored, seen, kept = jnp.sum(counts[:, :4], axis=0).astype(jnp.float32)
    seen = jnp.maximum(seen, 1.0)
    stats = dict(scored_fraction=scored / seen, rescored_fraction=(scored - initial) / seen,
                 rounds=jnp.max(rounds), candidate_blocks=plan.n_cand,
                 union_blocks=plan.n_union, kept_blocks=kept / T,
                 run_blocks=jnp.mean(counts[:, 4].astype(jnp.float32)))
    return tokens, stats


def hierarchical_topk(q, w, k, top_k, config=HierarchicalConfig(), *, q_offset=0,
                      summaries=None, screen=None, backend=None, key_ratio=1):
    """Top_k keys per query by coarse-to-fine block selection -> i32[T, top_k].

    Same contract as `flat_topk` (-1 in the last slots where fewer than top_k tokens are
    visible; query i at position q_offset + i), except the order: best first in exact mode
    or without fast_ranking, unordered with it. config: HierarchicalConfig. summaries: the keys'
    BlockSummaryCache when already maintained (decode, model prefill), at least
    ceil(L / block_size) blocks; None builds them from k. With config.exact the result
    equals flat top_k as sets (ties aside); otherwise it is flat top_k restricted to each
    query's candidate blocks. Raises ValueError when top_k is not a positive int,
    config.candidate_tokens < top_k, config.coarse_heads > H_I or summaries hold fewer
    blocks than the keys need, or config.coarse is "learned" without `screen` (the layer's
    indexer.coarse_screen.ScreenParams); TypeError when config is not a HierarchicalConfig.
    key_ratio r: key s summarises positions [s r, (s + 1) r) and is visible once they all
    are (indexer.scoring.flat_topk); block_size, candidate_tokens and the summaries then
    count keys, not positions (DeepSeek-V4's CSA entries; exact mode is refused).
    """
    return _hierarchical(q, w, k, top_k, config, q_offset=q_offset, summaries=summaries,
                         screen=screen, backend=backend, with_stats=False, key_ratio=key_ratio)


def hierarchical_select(q, w, k, top_k, *, q_offset, config, summaries=None, screen=None,
                        key_ratio=1):
    """The "hierarchical" selection kind (indexer.selection): hierarchical_topk with the
    layer's HierarchicalConfig."""
    return hierarchical_topk(q, w, k, top_k, config, q_offset=q_offset, summaries=summaries,
                             screen=screen, key_ratio=key_ratio)
