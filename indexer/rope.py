"""Rotary position embeddings, non-interleaved (rotate-half) layout.

Lives in `indexer` because both the indexer and the model use it and dependencies point
from model to indexer, never back.
"""

import jax.numpy as jnp


def rope_angles(positions, dim, *, theta=10000.0, scaling=1.0):
    """positions: i32[T] -> (cos, sin), each f32[T, dim // 2].

    scaling > 1 is linear position interpolation: positions are divided by it so a model
    trained at length N sees positions of a context scaling * N in its trained range.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = (positions.astype(jnp.float32) / scaling)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


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


def apply_partial_rope(x, positions, rope_dim, *, theta=10000.0, scaling=1.0):
    """RoPE on the first rope_dim dims of x [T, ..., d]; the rest pass through (V3.2 indexer)."""
    if rope_dim == 0:
        return x
    cos, sin = rope_angles(positions, rope_dim, theta=theta, scaling=scaling)
    rotated = apply_rope(x[..., :rope_dim], cos, sin)
    return jnp.concatenate([rotated, x[..., rope_dim:]], axis=-1)
