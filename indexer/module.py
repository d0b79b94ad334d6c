"""The lightning indexer as an NNX module: it owns the projections, the math is elsewhere."""

import jax.numpy as jnp
from flax import nnx

from indexer.coarse_screen import ScreenParams, untrained_screen
from indexer.rope import apply_partial_rope


class LightningIndexer(nnx.Module):
    """DSA lightning indexer projections (DeepSeek-V3.2).

    q_I = W_q(h_q) [T, H_I, d_I] from the query input (the hidden state, or V3.2's q-LoRA
    residual: q_dim its width); k_I = LayerNorm(W_k(x)) [T, d_I], one key per token shared
    by all indexer heads; w = W_w(x) * H_I^-0.5 * d_I^-0.5 [T, H_I]. RoPE on the first
    rope_dim dims of q_I and k_I: rotate-half (V3.2), or interleaved pairs (GLM-5:
    rope_interleaved), with linear interpolation `rope_scaling` or YaRN frequencies (`yarn`).
    """

    def __init__(self, d_model, heads, dim, rope_dim, *, rngs, rope_theta=10000.0,
                 rope_scaling=1.0, dtype=jnp.float32, param_dtype=jnp.float32, q_dim=None,
                 yarn=None, rope_interleaved=False):
        init = nnx.initializers.lecun_normal()
        self.heads, self.dim, self.rope_dim = heads, dim, rope_dim
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.yarn, self.rope_interleaved = yarn, rope_interleaved
        lin = dict(use_bias=False, kernel_init=init, dtype=dtype, param_dtype=param_dtype,
                   rngs=rngs)
        self.wq = nnx.Linear(q_dim or d_model, heads * dim, **lin)
        self.wk = nnx.Linear(d_model, dim, **lin)
        self.k_norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
        self.ww = nnx.Linear(d_model, heads, **lin)

    def __call__(self, x, positions, query_hidden=None, query_rows=None):
        """x: [T, d_model], positions: i32[T] -> (q [T, H_I, d_I], w [T, H_I], k [T, d_I]).

        query_rows: None, or i32[R] rows of the T tokens: q and w only there ([R, ...]; a
        teacher cache trains on a few hundred queries of an 8K window, keys at every token)."""
        hq = x if query_hidden is None else query_hidden
        xw, q_positions = x, positions
        if query_rows is not None:
            hq, xw, q_positions = hq[query_rows], x[query_rows], positions[query_rows]
        rope = dict(theta=self.rope_theta, scaling=self.rope_scaling, yarn=self.yarn,
                    interleaved=self.rope_interleaved)
        q = self.wq(hq).reshape(hq.shape[0], self.heads, self.dim)
        q = apply_partial_rope(q, q_positions, self.rope_dim, **rope)
        k = apply_partial_rope(self.k_norm(self.wk(x)), positions, self.rope_dim, **rope)
        w = self.ww(xw).astype(jnp.float32) * (self.heads**-0.5 * self.dim**-0.5)
        return q, w, k


class ScreenParam(nnx.Variable):
    """A coarse-screen parameter. Not an nnx.Param on purpose: the model's training and its
    checkpoints (which take nnx.Param) leave the screen alone; it is distilled afterwards
    with the model frozen and stored in its own file (model.coarse_screen_file)."""


class CoarseScreen(nnx.Module):
    """One layer's learned coarse screen (indexer.coarse_screen): per-head, per-dimension
    scales of the indexer's queries against block features [mean | max | min], and the
    temperatures of its block distribution. Initialised to the mean screen, temperatures 1."""

    def __init__(self, heads, dim):
        init = untrained_screen(heads, dim)
        self.scales = ScreenParam(init.scales)
        self.log_temperature = ScreenParam(init.log_temperature)
        self.mean_log_temperature = ScreenParam(init.mean_log_temperature)

    def params(self):
        return ScreenParams(self.scales[...], self.log_temperature[...],
                            self.mean_log_temperature[...])
