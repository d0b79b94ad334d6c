"""Grouped-query attention with a dense path and a DSA sparse path, over a KV cache."""

import jax
import jax.numpy as jnp
from flax import nnx

from indexer.rope import apply_rope, rope_angles
from indexer.selection import selection_kind


def dense_causal_attention(q, k, v, *, q_offset=0, scale=None, return_head_sum=False,
                           head_sum_rows=None):
    """q: [T, H, D], k: [L, H_kv, D], v: [L, H_kv, Dv] -> out [T, H, Dv].

    Query i at position q_offset + i sees keys j <= q_offset + i. Softmax in fp32.
    return_head_sum: also return p f32[T, L], the attention probabilities summed over the
    H heads and L1-normalised per query (the indexer's KL target), as (out, p).
    head_sum_rows: i32[R] (indices into the T queries; traced is fine): p only at those
    rows, f32[R, L] (a teacher cache keeps a few hundred rows of an 8K window, not 8K).
    """
    T, H, D = q.shape
    L, H_kv, _ = k.shape
    scale = D**-0.5 if scale is None else scale
    qg = q.reshape(T, H_kv, H // H_kv, D)
    logits = jnp.einsum("tgrd,lgd->tgrl", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(L)[None, :] <= (q_offset + jnp.arange(T))[:, None]
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("tgrl,lgd->tgrd", probs, v.astype(jnp.float32))
    out = out.reshape(T, H, v.shape[-1]).astype(q.dtype)
    if not return_head_sum:
        return out
    p = jnp.sum(probs if head_sum_rows is None else probs[head_sum_rows], axis=(1, 2))
    return out, p / jnp.sum(p, axis=-1, keepdims=True)


def select_tokens(config, layer, q_index, w_index, k_index, *, q_offset, summaries=None,
                  screen=None):
    """Layer `layer`'s top_k selection for queries at q_offset.. -> i32[T, top_k] (-1 padded):
    the selection kind config.layer_indexer(layer) names (indexer.selection), with the
    layer's HierarchicalConfig (config.layer_hierarchical). k_index: [L, d_I], the
    indexer-key cache up to a length bucket (positions past the queries are masked by
    causality); summaries: the cache's BlockSummaryCache of k_index; screen: the layer's
    trained coarse screen (indexer.ScreenParams) or None."""
    kind = selection_kind(config.layer_indexer(layer), what="ModelConfig.indexer")
    return kind.function(q_index, w_index, k_index, config.top_k, q_offset=q_offset,
                         config=config.layer_hierarchical(config.selection_source(layer)),
                         summaries=summaries, screen=screen)


class Attention(nnx.Module):
    """Grouped-query attention's projections + RoPE (the model's own and Llama-family
    checkpoints); the attention itself is one of two pure functions over the (keys, values)
    this module reads from the cache. model/mla.py is the other attention kind, with the
    same four members: project, read, output, scale."""

    CACHE_FIELDS = ("k", "v")  # model.cache.FIELDS: what a GQA layer caches

    def __init__(self, config, *, rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        c = config
        init = nnx.initializers.lecun_normal()
        lin = dict(use_bias=False, kernel_init=init, dtype=dtype, param_dtype=param_dtype,
                   rngs=rngs)
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.rope_theta, self.rope_scaling, self.yarn = c.rope_theta, c.rope_scaling, c.yarn
        self.scale = c.head_dim ** -0.5
        self.wq = nnx.Linear(c.d_model, c.n_heads * c.head_dim, **lin)
        self.wk = nnx.Linear(c.d_model, c.n_kv_heads * c.head_dim, **lin)
        self.wv = nnx.Linear(c.d_model, c.n_kv_heads * c.head_dim, **lin)
        self.wo = nnx.Linear(c.n_heads * c.head_dim, c.d_model, **lin)

    def project(self, x, positions):
        """x: [T, d_model] -> (q [T, H, D] with RoPE, cache rows {"k", "v": [T, H_kv, D]},
        the indexer's query input: None, the hidden state itself)."""
        T = x.shape[0]
        cos, sin = rope_angles(positions, self.head_dim, theta=self.rope_theta,
                               scaling=self.rope_scaling, yarn=self.yarn)
        q = apply_rope(self.wq(x).reshape(T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).reshape(T, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).reshape(T, self.n_kv_heads, self.head_dim)
        return q, {"k": k, "v": v}, None

    @staticmethod
    def read(rows):
        """Cache rows -> (keys [L, H_kv, D], values [L, H_kv, D])."""
        return rows["k"], rows["v"]

    def output(self, attn):
        return self.wo(attn.reshape(attn.shape[0], -1))
