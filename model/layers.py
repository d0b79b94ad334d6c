"""Small building blocks: RMSNorm, SwiGLU MLP (RoPE comes from indexer.rope)."""

import jax
import jax.numpy as jnp
from flax import nnx



class RMSNorm(nnx.Module):
    def __init__(self, dim, *, eps=1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, d_model, d_ff, *, rngs, dtype=jnp.float32):
        init = nnx.initializers.lecun_normal()
        self.gate = nnx.Linear(d_model, d_ff, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
