"""Small building blocks: RMSNorm, SwiGLU MLP (RoPE comes from indexer.rope)."""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x, weight, eps):
    """x / rms(x) over the last axis, times weight (None: unweighted), in float32; returned
    in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y if weight is None else y * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim, *, eps=1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


def swiglu(gate, up, limit=None):
    """silu(gate) * up; with a limit (DeepSeek-V4's swiglu_limit) gate clamped at most
    limit and up to [-limit, limit] first."""
    if limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


class SwiGLU(nnx.Module):
    def __init__(self, d_model, d_ff, *, rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 limit=None):
        lin = dict(use_bias=False, kernel_init=nnx.initializers.lecun_normal(), dtype=dtype,
                   param_dtype=param_dtype, rngs=rngs)
        self.gate = nnx.Linear(d_model, d_ff, **lin)
        self.up = nnx.Linear(d_model, d_ff, **lin)
        self.down = nnx.Linear(d_ff, d_model, **lin)
        self.limit = limit

    def __call__(self, x):
        return self.down(swiglu(self.gate(x), self.up(x), self.limit))
