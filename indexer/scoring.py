"""Flat lightning-indexer scoring and top-k selection (pure functions over arrays)."""

import functools

import jax
import jax.numpy as jnp

import pallas_kernels

DEFAULT_QUERY_CHUNK = 512


def index_scores(q, w, k, *, q_offset=0, backend=None):
    """I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]), causal.

    q: [T, H_I, d_I], w: [T, H_I], k: [L, d_I] -> f32[T, L]; query i sits at absolute
    position q_offset + i, key j at position j; entries with j > q_offset + i are -inf.
    """
    return pallas_kernels.index_scores(q, w, k, q_offset=q_offset, backend=backend)


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


def signless_zeros(scores):
    """-0.0 -> 0.0. lax.top_k orders -0.0 below 0.0, and which sign a zero score gets
    (ReLU'd heads times negative weights) depends on the summation order, so a score
    computed over a key tile and over the whole row could rank differently; equal scores
    go to the lower index instead."""
    return jnp.where(scores == 0, jnp.float32(0), scores)


def _check_topk(top_k):
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")


def query_chunks(q, w, q_offset, query_chunk):
    """q [T, H, d], w [T, H] zero-padded into chunks of min(query_chunk, T) rows ->
    (q [n, chunk, H, d], w [n, chunk, H], each chunk's first position i32[n])."""
    T = q.shape[0]
    chunk = min(query_chunk, T)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(n_chunks, chunk, *q.shape[1:])
    wp = jnp.pad(w, ((0, pad), (0, 0))).reshape(n_chunks, chunk, w.shape[1])
    return qp, wp, q_offset + chunk * jnp.arange(n_chunks)


@functools.partial(jax.jit, static_argnames=("top_k", "query_chunk", "backend"))
def flat_topk(q, w, k, top_k, *, q_offset=0, query_chunk=DEFAULT_QUERY_CHUNK, backend=None):
    """Exact top_k keys per query by flat index scores -> i32[T, top_k], best first.

    Scores query chunks of `query_chunk` rows at a time, so memory is O(query_chunk * L),
    never [T, L]. -1 where fewer than top_k keys are visible (s <= q_offset + t).
    """
    _check_topk(top_k)
    T = q.shape[0]
    qp, wp, starts = query_chunks(q, w, q_offset, query_chunk)
    n_chunks, chunk = qp.shape[:2]

    def one_chunk(args):
        qc, wc, start = args
        return topk_indices(index_scores(qc, wc, k, q_offset=start, backend=backend), top_k)

    out = jax.lax.map(one_chunk, (qp, wp, starts))
    return out.reshape(n_chunks * chunk, top_k)[:T]


def flat_select(q, w, k, top_k, *, q_offset, config=None, summaries=None, screen=None):
    """The "flat" selection kind (indexer.selection): flat_topk."""
    return flat_topk(q, w, k, top_k, q_offset=q_offset)


def window_select(q, w, k, top_k, *, q_offset, config=None, summaries=None, screen=None):
    """The "window" selection kind: the query and the top_k - 1 tokens before it, most
    recent first (sliding-window attention with no scoring)."""
    positions = q_offset + jnp.arange(q.shape[0])
    window = positions[:, None] - jnp.arange(top_k)[None, :]
    return jnp.where(window >= 0, window, -1).astype(jnp.int32)


def oracle_select(target, top_k, *, q_offset):
    """The "oracle" selection kind: each query's top_k keys by target f32[T, kv_len] (the
    layer's dense attention averaged over heads) among the keys it sees; -1 where fewer
    than top_k are visible. Ties (attention that underflowed to 0) go to the lower index."""
    _check_topk(top_k)
    T, L = target.shape
    visible = jnp.arange(L)[None, :] <= (q_offset + jnp.arange(T))[:, None]
    return topk_indices(jnp.where(visible, target.astype(jnp.float32), -jnp.inf), top_k)
