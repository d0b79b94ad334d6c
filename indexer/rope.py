"""Rotary position embeddings, non-interleaved (rotate-half) layout, with linear position
interpolation or YaRN (indexer.config.YarnConfig) frequencies.

Lives in `indexer` because both the indexer and the model use it and dependencies point
from model to indexer, never back. Checkpoints that rotate interleaved pairs (x[2i],
x[2i+1]: DeepSeek's MLA, GLM-5's indexer) are handled by `deinterleave`: the same
permutation of the rotated dimensions of queries and keys leaves every dot product as the
interleaved rotation gives it.
"""

import jax.numpy as jnp
import numpy as np


def rope_angles(positions, dim, *, theta=10000.0, scaling=1.0, yarn=None):
    """positions: i32[T] -> (cos, sin), each f32[T, dim // 2].

    scaling > 1 is linear position interpolation: positions are divided by it so a model
    trained at length N sees positions of a context scaling * N in its trained range.
    yarn: a YarnConfig (its frequencies, and cos/sin times its attention factor).
    """
    if yarn is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
        factor = 1.0
    else:
        inv_freq = jnp.asarray(np.asarray(yarn.inverse_frequencies(dim, theta), np.float32))
        factor = yarn.cos_sin_factor()
    angles = (positions.astype(jnp.float32) / scaling)[:, None] * inv_freq[None, :]
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def deinterleave(x):
    """The last axis reordered [x0, x2, x4, ..., x1, x3, ...]: interleaved RoPE pairs into
    the rotate-half layout (apply to queries and keys alike)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def apply_rope(x, cos, sin):
    """Non-interleaved (rotate-half) RoPE on the last axis of x: [T, ..., dim].

    cos/sin: [T, dim // 2]; broadcast over the middle axes.
    """
    half = x.shape[-1] // 2
    extra = (1,) * (x.ndim - 2)
    cos = cos.reshape(cos.shape[0], *extra, half)
    sin = sin.reshape(sin.shape[0], *extra, half)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_partial_rope(x, positions, rope_dim, *, theta=10000.0, scaling=1.0, yarn=None,
                       interleaved=False):
    """RoPE on the first rope_dim dims of x [T, ..., d]; the rest pass through (V3.2 indexer).
    interleaved: those dims hold interleaved pairs (GLM-5's indexer)."""
    if rope_dim == 0:
        return x
    cos, sin = rope_angles(positions, rope_dim, theta=theta, scaling=scaling, yarn=yarn)
    head = x[..., :rope_dim]
    rotated = apply_rope(deinterleave(head) if interleaved else head, cos, sin)
    return jnp.concatenate([rotated, x[..., rope_dim:]], axis=-1)
