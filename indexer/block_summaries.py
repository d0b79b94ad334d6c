"""Per-block summaries of the indexer keys, and their incremental cache for decode.

Block b covers token positions [b * B, (b + 1) * B). Its summary is the sum and count of
its keys (the pooled key is sum / count), the per-dimension min and max, and, once the
block is complete, its radius: the largest distance of its keys from their mean (min, max
and radius give the upper bounds of exact mode, see indexer.exact). Summaries are built
once for a context and then extended as tokens are appended: `append` costs O(d_I) per
token and never revisits earlier tokens, except that the token completing a block reads
that block's B keys once for its radius (O(d_I) amortised).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockSummaryCache(NamedTuple):
    """Summaries of n_blocks key blocks (a pytree; pure updates return a new one).

    sum: f32[n_blocks, d_I]; count: i32[n_blocks] (tokens appended so far);
    min, max: f32[n_blocks, d_I], +inf / -inf in empty blocks;
    radius: f32[n_blocks], max_s |k_s - mean| over a complete block's keys (slightly
    inflated to cover rounding), +inf while the block is incomplete or it was not computed.
    """

    sum: jax.Array
    count: jax.Array
    min: jax.Array
    max: jax.Array
    radius: jax.Array

    @property
    def n_blocks(self):
        return self.count.shape[0]


def num_blocks(length, block_size):
    return -(-int(length) // int(block_size))


# Each summary field: (dtype, whether it has a d_I axis, what an empty block holds). The
# model's cache (model.cache) builds its summary fields from this table.
SUMMARY_LAYOUT = {
    "sum": ("float32", True, 0.0),
    "count": ("int32", False, 0),
    "min": ("float32", True, float("inf")),
    "max": ("float32", True, float("-inf")),
    "radius": ("float32", False, float("inf")),
}


def empty_summaries(n_blocks, dim):
    """Summaries of n_blocks empty blocks of d_I = dim."""
    return BlockSummaryCache(**{
        name: jnp.full((n_blocks, dim) if per_dim else (n_blocks,), fill, dtype)
        for name, (dtype, per_dim, fill) in SUMMARY_LAYOUT.items()})


def _radius(rows, total, count, block_size):
    """Radius of blocks with keys rows [n, B, d] and key sums total [n, d]; +inf unless
    count == block_size. Inflated by a relative 1e-5 so rounding never makes it too small."""
    mean = total / block_size
    dist = jnp.sqrt(jnp.max(jnp.sum(jnp.square(rows - mean[:, None, :]), axis=-1), axis=-1))
    return jnp.where(count == block_size, dist * (1 + 1e-5) + 1e-6, jnp.inf)


def block_summaries(k, block_size, *, length=None):
    """Summaries of k [L, d_I] from scratch (prefill of a whole context, tests).

    length: number of leading tokens that are real (python int or traced; default L);
    the rest are ignored. Returns ceil(L / block_size) blocks.
    """
    L, d = k.shape
    nb = num_blocks(L, block_size)
    n_valid = L if length is None else length
    kp = jnp.pad(k.astype(jnp.float32), ((0, nb * block_size - L), (0, 0)))
    kp = kp.reshape(nb, block_size, d)
    valid = (jnp.arange(nb * block_size) < n_valid).reshape(nb, block_size, 1)
    total = jnp.sum(jnp.where(valid, kp, 0.0), axis=1)
    count = jnp.sum(valid[..., 0], axis=1, dtype=jnp.int32)
    return BlockSummaryCache(
        sum=total,
        count=count,
        min=jnp.min(jnp.where(valid, kp, jnp.inf), axis=1),
        max=jnp.max(jnp.where(valid, kp, -jnp.inf), axis=1),
        radius=_radius(kp, total, count, block_size),
    )


def _at(array, layer, index):
    """array.at[index], or array.at[layer, index] when the array carries a leading layer
    axis (a stack of layers' summaries, updated in place at one layer: model.layer_cache)."""
    return array.at[index] if layer is None else array.at[layer, index]


def _of(array, layer):
    return array if layer is None else jax.lax.dynamic_index_in_dim(array, layer, keepdims=False)


def append(cache, k_new, start, *, block_size, n_valid=None, keys=None, layer=None):
    """Appends keys k_new [T, d_I] at positions start..start+T-1 -> new cache.

    start: python int or traced scalar. n_valid: only the first n_valid rows are real
    (padding of a bucketed prefill chunk; traced is fine); default T. Rows past the last
    block are dropped. keys: the key cache [C, d_I] with k_new already written (C a
    multiple of block_size or longer than the last block), to compute the radius of the
    blocks this append completes; None leaves radii at +inf (bounds fall back to min/max).
    layer: None, or the index (traced is fine) of the layer to update when the cache's
    arrays carry a leading layer axis (the others are left as they are).
    O(T * d_I): a scatter into the touched blocks, plus B keys per completed block.
    """
    T = k_new.shape[0]
    nb = cache.count.shape[-1]
    rows = jnp.arange(T)
    n_valid = T if n_valid is None else n_valid
    valid = rows < n_valid
    blocks = jnp.where(valid, (start + rows) // block_size, nb)  # nb: out of range, dropped
    kf = k_new.astype(jnp.float32)
    before = _of(cache.count, layer)
    out = BlockSummaryCache(
        sum=_at(cache.sum, layer, blocks).add(kf, mode="drop"),
        count=_at(cache.count, layer, blocks).add(1, mode="drop"),
        min=_at(cache.min, layer, blocks).min(kf, mode="drop"),
        max=_at(cache.max, layer, blocks).max(kf, mode="drop"),
        radius=cache.radius,
    )
    if keys is None:
        return out
    # Blocks this append can complete: those holding positions start .. start + T - 1.
    touched = start // block_size + jnp.arange((T - 1) // block_size + 2)
    ids = jnp.clip(touched, 0, nb - 1)
    completes = ((touched < nb) & (_of(out.count, layer)[ids] == block_size)
                 & (before[ids] < block_size))

    def with_radii(out):
        pos = ids[:, None] * block_size + jnp.arange(block_size)
        kr = keys.astype(jnp.float32)[jnp.clip(pos, 0, keys.shape[0] - 1)]
        r = _radius(kr, _of(out.sum, layer)[ids], _of(out.count, layer)[ids], block_size)
        radius = _at(out.radius, layer, jnp.where(completes, ids, nb)).set(r, mode="drop")
        return out._replace(radius=radius)

    return jax.lax.cond(jnp.any(completes), with_radii, lambda o: o, out)


def refresh(cache, keys, first, n_rows, whole, *, block_size, layer=None):
    """The summaries of the blocks holding key rows first .. first + n_rows - 1 rebuilt
    from keys [C, d_I] (the key cache, those rows already written), counting only the rows
    below `whole`: for keys that are rewritten until final (DeepSeek-V4's compressed
    entries: provisional until their window is whole), where `append` cannot retract.
    first, whole: traced scalars are fine; n_rows static; layer: as `append`'s.
    O((n_rows + 2 block_size) d_I)."""
    nb = cache.count.shape[-1]
    n_touched = (n_rows - 1) // block_size + 2
    touched = first // block_size + jnp.arange(n_touched)
    rows = touched[:, None] * block_size + jnp.arange(block_size)
    kr = keys[jnp.clip(rows, 0, keys.shape[0] - 1)].astype(jnp.float32)
    valid = ((rows < whole) & (rows < keys.shape[0]))[..., None]
    total = jnp.sum(jnp.where(valid, kr, 0.0), axis=1)
    count = jnp.sum(valid[..., 0], axis=1, dtype=jnp.int32)
    rebuilt = BlockSummaryCache(
        sum=total, count=count,
        min=jnp.min(jnp.where(valid, kr, jnp.inf), axis=1),
        max=jnp.max(jnp.where(valid, kr, -jnp.inf), axis=1),
        radius=_radius(kr, total, count, block_size))
    ids = jnp.where(touched < nb, touched, nb)  # past the cache: dropped
    return BlockSummaryCache(*(_at(c, layer, ids).set(r, mode="drop")
                               for c, r in zip(cache, rebuilt)))


def truncate(cache, k, length, *, block_size):
    """Rolls the summaries back to the first `length` tokens (e.g. a cache reused from a
    shorter prefix): the partial block is rebuilt from k [C, d_I] (the key cache), later
    blocks are emptied. O(block_size * d_I + n_blocks)."""
    nb, d = cache.sum.shape
    b = length // block_size
    kp = jnp.pad(k, ((0, block_size), (0, 0)))
    rows = jax.lax.dynamic_slice_in_dim(kp, b * block_size, block_size, axis=0)
    part = block_summaries(rows, block_size, length=length - b * block_size)
    keep = jnp.arange(nb) < b
    emptied = empty_summaries(nb, d)
    out = BlockSummaryCache(*(jnp.where(keep.reshape((nb,) + (1,) * (c.ndim - 1)), c, e)
                              for c, e in zip(cache, emptied)))
    return _set_block(out, part, b)


def _set_block(cache, one, b):
    """cache with block b replaced by the single-block summary `one` (no-op if b >= nb)."""
    nb = cache.count.shape[0]
    idx = jnp.where(b < nb, b, nb)
    return BlockSummaryCache(*(c.at[idx].set(o[0], mode="drop") for c, o in zip(cache, one)))


def slice_blocks(cache, n_blocks):
    """The first n_blocks blocks (static)."""
    return BlockSummaryCache(*(c[:n_blocks] for c in cache))


def block_means(cache):
    """Pooled keys f32[n_blocks, d_I]: mean of each block's keys (0 for empty blocks)."""
    return cache.sum / jnp.maximum(cache.count, 1)[:, None].astype(jnp.float32)


def bound_keys(cache):
    """[max | min] per block, f32[n_blocks, 2 d_I], finite (0 in empty blocks), for the
    upper-bound products of exact mode (see indexer.exact)."""
    nonempty = (cache.count > 0)[:, None]
    return jnp.concatenate([jnp.where(nonempty, cache.max, 0.0),
                            jnp.where(nonempty, cache.min, 0.0)], axis=1)


def visible_blocks(q_positions, summaries, block_size):
    """bool[T, n_blocks]: block b is non-empty and starts at or before the query position
    (q_positions i32[T]; -1 marks a padding row, which sees nothing)."""
    nb = summaries.count.shape[0]
    starts = block_size * jnp.arange(nb)
    return (starts[None, :] <= q_positions[:, None]) & (summaries.count > 0)[None, :]
