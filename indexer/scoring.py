"""Flat lightning-indexer scoring and top-k selection (pure functions over arrays)."""

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from indexer.config import FAST_RANKING_ROUNDS

# Queries scored per step when the caller does not say. The xla path writes its per-head
# logits [rows, H_I, L] f32 (and their ReLU) before summing the heads, so on CPU small steps
# win: flat_topk on the 2-core CPU at 8K-64K, top_k 256 and 1024, is fastest at 64 rows or
# within noise of it at every length (64K, 1024 queries: 1.06 s and 146 MiB peak at 64 rows
# against 1.72 s and 1042 MiB at 512; docs/design.md, "Query steps on the xla path"), and
# rows shrink further at long context so the logits stay within XLA_SCORE_BYTES. The Pallas kernels
# keep only [rows, L] and want rows for parallelism: PALLAS_QUERY_CHUNK.
XLA_QUERY_CHUNK = 64
XLA_MIN_QUERY_CHUNK = 8
XLA_SCORE_BYTES = 64 << 20
PALLAS_QUERY_CHUNK = 512


def index_scores(q, w, k, *, q_offset=0, key_block_size=1, backend=None):
    """I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]), causal.

    q: [T, H_I, d_I], w: [T, H_I], k: [L, d_I] -> f32[T, L]; query i sits at absolute
    position q_offset + i, key j at position j * key_block_size (a key per block of
    positions: block summaries, DeepSeek-V4's compressed entries); entries with
    j * key_block_size > q_offset + i are -inf.
    """
    return pallas_kernels.index_scores(q, w, k, q_offset=q_offset,
                                       key_block_size=key_block_size, backend=backend)


def topk_indices(scores, top_k):
    """Best-first indices of each row's top_k finite scores; -1 where fewer exist.

    scores: f32[T, L] with -inf for invisible keys -> i32[T, top_k].
    """
    T, L = scores.shape
    scores = signless_zeros(scores)
    if top_k > L:
        scores = jnp.pad(scores, ((0, 0), (0, top_k - L)), constant_values=-jnp.inf)
    values, idx = jax.lax.top_k(scores, top_k)
    return jnp.where(jnp.isfinite(values), idx, -1).astype(jnp.int32)


def threshold_topk(scores, top_k, rounds=FAST_RANKING_ROUNDS):
    """The top_k of each row by a threshold instead of a sort: `rounds` halvings of
    [row min, row max] find a window [lo, hi] that holds the k-th largest score; every
    score above hi is kept, then scores in the window in column order (the lower column
    first, as lax.top_k breaks ties) until k are kept. Scores closer than (max - min) x
    2^-rounds to the k-th may be swapped for each other; the set is otherwise
    lax.top_k's. Returns (values, columns): those above the window in column order, then
    the window's (not best first); -inf and column 0 past the row's finite scores. On the
    2-core CPU, 1024 rows of 4096 / 5120 columns, top 1024: 25 / 38 ms, where one sort of
    packed keys took 50 ms (4096) and lax.top_k read newest first 126 ms (5120)
    (experiments.benchmarks.ranking; docs/findings.md, "Ranking by a threshold")."""
    T, C = scores.shape
    scores = scores.astype(jnp.float32)
    finite = scores > -jnp.inf
    any_finite = jnp.any(finite, axis=1, keepdims=True)
    lo = jnp.where(any_finite, jnp.min(jnp.where(finite, scores, jnp.inf), axis=1,
                                       keepdims=True), 0.0)
    hi = jnp.where(any_finite, jnp.max(scores, axis=1, keepdims=True), 0.0)

    def halve(_, window):  # invariant: fewer than top_k scores above hi
        lo, hi = window
        mid = lo + (hi - lo) * 0.5
        enough = jnp.sum(scores >= mid, axis=1, keepdims=True) >= top_k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, hi = jax.lax.fori_loop(0, rounds, halve, (lo, hi))
    above = scores > hi
    window = (scores >= lo) & ~above & finite
    if C < 1 << 16:  # one cumulative sum counts both kinds: above in the low 16 bits
        counts = jnp.cumsum(above.astype(jnp.uint32) | (window.astype(jnp.uint32) << 16),
                            axis=1)
        n_above, n_window = (counts & 0xFFFF).astype(jnp.int32), (counts >> 16).astype(jnp.int32)
    else:
        n_above = jnp.cumsum(above, axis=1, dtype=jnp.int32)
        n_window = jnp.cumsum(window, axis=1, dtype=jnp.int32)
    slot = jnp.where(above, n_above - 1,
                     jnp.where(window, n_above[:, -1:] + n_window - 1, top_k))
    cols = jnp.full((T, top_k + 1), C, jnp.int32).at[
        jnp.arange(T)[:, None], jnp.minimum(slot, top_k)].set(
        jnp.arange(C, dtype=jnp.int32)[None], mode="drop")[:, :top_k]
    kept = cols < C
    cols = jnp.where(kept, cols, 0)
    values = jnp.where(kept, jnp.take_along_axis(scores, cols, axis=1), -jnp.inf)
    return values, cols


def signless_zeros(scores):
    """-0.0 -> 0.0. lax.top_k orders -0.0 below 0.0, and which sign a zero score gets
    (ReLU'd heads times negative weights) depends on the summation order, so a score
    computed over a key tile and over the whole row could rank differently; equal scores
    go to the lower index instead."""
    return jnp.where(scores == 0, jnp.float32(0), scores)


def _check_topk(top_k):
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")


def default_query_chunk(key_len, heads, backend=None):
    """Queries per scoring step for keys of length key_len (the comment above
    XLA_QUERY_CHUNK): a power of two."""
    if (backend or pallas_kernels.resolve("index_scores")) != "xla":
        return PALLAS_QUERY_CHUNK
    return pallas_kernels.rows_within(XLA_SCORE_BYTES, 4 * heads * key_len, XLA_QUERY_CHUNK,
                                      XLA_MIN_QUERY_CHUNK)


def _check_query_chunk(query_chunk):
    if query_chunk is not None and (not isinstance(query_chunk, int) or query_chunk < 1):
        raise ValueError(f"query_chunk must be None or a positive int, got {query_chunk!r}")


def check_key_ratio(key_ratio):
    if not isinstance(key_ratio, int) or key_ratio < 1:
        raise ValueError(f"key_ratio must be a positive int, got {key_ratio!r}")


def last_visible_key(positions, key_ratio):
    """The last key a query at each position sees when key s summarises positions
    [s key_ratio, (s + 1) key_ratio) and becomes visible once all of them are:
    (p + 1) // key_ratio - 1 (-1: none yet). key_ratio 1: the position itself."""
    return (positions + 1) // key_ratio - 1


@functools.partial(jax.jit, static_argnames=("top_k", "query_chunk", "backend",
                                             "fast_ranking", "key_ratio"))
def flat_topk(q, w, k, top_k, *, q_offset=0, query_chunk=None, backend=None,
              fast_ranking=False, key_ratio=1):
    """Exact top_k keys per query by flat index scores -> i32[T, top_k], best first
    (fast_ranking: by threshold_topk, near-ties either way, not best first).

    Scores query chunks of `query_chunk` rows at a time (None: default_query_chunk), so
    memory is O(query_chunk * L), never [T, L]. -1 where fewer than top_k keys are visible
    (s <= q_offset + t; with key_ratio r, key s summarises positions [s r, (s + 1) r) and
    is visible once they all are: (s + 1) r - 1 <= q_offset + t, DeepSeek-V4's CSA
    entries).
    """
    _check_topk(top_k)
    check_key_ratio(key_ratio)
    _check_query_chunk(query_chunk)
    if query_chunk is None:
        query_chunk = default_query_chunk(k.shape[0], q.shape[1], backend)

    def one_chunk(first_row, qc, wc):
        # The kernel's block causality (key s at position s r) for queries placed r - 1
        # positions earlier is the whole-window rule.
        scores = index_scores(qc, wc, k, q_offset=q_offset + first_row - (key_ratio - 1),
                              key_block_size=key_ratio, backend=backend)
        if not fast_ranking:
            return topk_indices(scores, top_k)
        if top_k > scores.shape[1]:
            scores = jnp.pad(scores, ((0, 0), (0, top_k - scores.shape[1])),
                             constant_values=-jnp.inf)
        values, cols = threshold_topk(signless_zeros(scores), top_k)
        return jnp.where(values > -jnp.inf, cols, -1).astype(jnp.int32)

    return pallas_kernels.map_query_rows(one_chunk, query_chunk, (q, w))


def flat_select(q, w, k, top_k, *, q_offset, config=None, summaries=None, screen=None,
                key_ratio=1):
    """The "flat" selection kind (indexer.selection): flat_topk, ranked as `config` (a
    FlatConfig; None: lax.top_k) says."""
    return flat_topk(q, w, k, top_k, q_offset=q_offset,
                     fast_ranking=config is not None and config.fast_ranking,
                     key_ratio=key_ratio)


def window_select(q, w, k, top_k, *, q_offset, config=None, summaries=None, screen=None,
                  key_ratio=1):
    """The "window" selection kind: the query's last visible key and the top_k - 1 keys
    before it, most recent first (sliding-window attention with no scoring)."""
    check_key_ratio(key_ratio)
    last = last_visible_key(q_offset + jnp.arange(q.shape[0]), key_ratio)
    window = last[:, None] - jnp.arange(top_k)[None, :]
    return jnp.where(window >= 0, window, -1).astype(jnp.int32)


def oracle_select(target, top_k, *, q_offset):
    """The "oracle" selection kind: each query's top_k keys by target f32[T, kv_len] (the
    layer's dense attention averaged over heads) among the keys it sees; -1 where fewer
    than top_k are visible. Ties (attention that underflowed to 0) go to the lower index."""
    _check_topk(top_k)
    T, L = target.shape
    visible = jnp.arange(L)[None, :] <= (q_offset + jnp.arange(T))[:, None]
    return topk_indices(jnp.where(visible, target.astype(jnp.float32), -jnp.inf), top_k)
