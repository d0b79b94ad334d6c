"""Streaming flat selection: flat's exact top_k, with the scores computed one key tile at a
time and merged into a running top_k, so no [queries x context] score matrix is stored
(vLLM's LiteTopK idea; TensorRT-LLM's radix select is the GPU analogue of the skip below).

Per chunk of `query_chunk` queries, tiles of `key_tile` keys are scored in order (only the
tiles some query of the chunk can see); each tile's scores meet the chunk's running best
(values, tokens):
- a tile where no score reaches any row's current k-th value changes nothing and costs no
  ranking at all (a threshold select);
- otherwise only the tile's best m are merged, m the smallest of FEW_IMPROVEMENTS x 4^i
  (capped at min(top_k, key_tile)) that holds every row's reaching scores.
A merge is lax.top_k of [running | new]: stable, so among equal scores the earlier token
(the running set holds earlier tiles, in score then token order) wins, exactly as flat's
single lax.top_k over the row does. The result is flat_topk's, index for index.

Peak memory per chunk: [query_chunk, key_tile + top_k] instead of [query_chunk, L].
"""

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from indexer.config import STREAMING_KEY_TILE
from indexer.scoring import (
    _check_query_chunk,
    _check_topk,
    check_key_ratio,
    default_query_chunk,
    index_scores,
    last_visible_key,
    signless_zeros,
)

FEW_IMPROVEMENTS = 32


def _merge(values, tokens, scores, first_token, take):
    """Running (values, tokens) [Q, top_k] merged with the best `take` of a tile's scores
    [Q, tile] whose column c is token first_token + c."""
    top_k = values.shape[1]
    new, cols = jax.lax.top_k(scores, take)
    merged, pick = jax.lax.top_k(jnp.concatenate([values, new], axis=1), top_k)
    candidates = jnp.concatenate([tokens, first_token + cols.astype(jnp.int32)], axis=1)
    return merged, jnp.take_along_axis(candidates, pick, axis=1)


def merge_sizes(top_k, tile):
    """The tile scores a merge may take: FEW_IMPROVEMENTS, x4 steps, min(top_k, tile)."""
    cap = min(top_k, tile)
    sizes, size = [], min(FEW_IMPROVEMENTS, cap)
    while size < cap:
        sizes.append(size)
        size *= 4
    return tuple(sizes) + (cap,)


def _tile_merge(values, tokens, scores, first_token):
    """One tile into the running top_k, paying only for what can change (module docstring):
    nothing when no score reaches a row's k-th value, else the smallest merge size that
    holds every row's reaching scores."""
    sizes = merge_sizes(values.shape[1], scores.shape[1])
    reach = (scores >= values[:, -1:]) & (scores > -jnp.inf)
    most = jnp.max(jnp.sum(reach, axis=1))
    branch = jnp.where(most == 0, 0, 1 + jnp.searchsorted(jnp.asarray(sizes), most))
    merges = [functools.partial(_merge, values, tokens, scores, first_token, size)
              for size in sizes]
    return jax.lax.switch(branch, [lambda: (values, tokens)] + merges)


@functools.partial(jax.jit, static_argnames=("top_k", "key_tile", "query_chunk", "backend",
                                             "key_ratio"))
def streaming_topk(q, w, k, top_k, *, q_offset=0, key_tile=STREAMING_KEY_TILE,
                   query_chunk=None, backend=None, key_ratio=1):
    """flat_topk's result (i32[T, top_k], best first, -1 where fewer than top_k keys are
    visible) without a [T, L] score matrix: see the module docstring.

    q [T, H_I, d_I], w [T, H_I], k [L, d_I]; query i sits at position q_offset + i (a
    traced int32 scalar is fine). key_tile: keys scored per step (the last tile is
    padded; padded keys are never visible). query_chunk: queries per step (None:
    indexer.scoring.default_query_chunk for one key tile). key_ratio: positions each key
    summarises (indexer.scoring.flat_topk).
    """
    _check_topk(top_k)
    check_key_ratio(key_ratio)
    _check_query_chunk(query_chunk)
    if not isinstance(key_tile, int) or key_tile < 1:
        raise ValueError(f"key_tile must be a positive int, got {key_tile!r}")
    T, L = q.shape[0], k.shape[0]
    tile = min(key_tile, L)
    if query_chunk is None:
        query_chunk = default_query_chunk(tile, q.shape[1], backend)
    chunk = min(query_chunk, T)
    n_tiles = -(-L // tile)
    kp = jnp.pad(k, ((0, n_tiles * tile - L), (0, 0)))

    def one_chunk(first_row, qc, wc):
        start = q_offset + first_row

        def body(j, best):
            first = j * tile
            kt = jax.lax.dynamic_slice_in_dim(kp, first, tile, axis=0)
            shift = start - (key_ratio - 1) - first * key_ratio
            scores = index_scores(qc, wc, kt, q_offset=shift, key_block_size=key_ratio,
                                  backend=backend)
            scores = jnp.where(first + jnp.arange(tile)[None, :] < L,
                               signless_zeros(scores), -jnp.inf)
            return _tile_merge(*best, scores, first)

        # Tiles past the chunk's last query are invisible to all of its rows.
        last_position = jnp.minimum(last_visible_key(start + chunk - 1, key_ratio), L - 1)
        seen = jnp.clip(last_position // tile + 1, 0, n_tiles)
        init = (jnp.full((chunk, top_k), -jnp.inf, jnp.float32),
                jnp.full((chunk, top_k), -1, jnp.int32))
        values, tokens = jax.lax.fori_loop(0, seen, body, init)
        return jnp.where(values > -jnp.inf, tokens, -1)

    return pallas_kernels.map_query_rows(one_chunk, chunk, (q, w))


def streaming_select(q, w, k, top_k, *, q_offset, config=None, summaries=None, screen=None,
                     key_ratio=1):
    """The "streaming" selection kind (indexer.selection): streaming_topk."""
    return streaming_topk(q, w, k, top_k, q_offset=q_offset, key_ratio=key_ratio)
