"""Grouped-query attention with a dense path and a DSA sparse path, over a KV cache."""

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from indexer.rope import apply_rope, rope_angles
from indexer.selection import selection_kind

# Dense attention on the xla backend runs DENSE_ATTENTION_ROWS queries at a time (fewer, a
# power of two, where a chunk's [rows, H, L] f32 logits, probabilities and their head sum
# would pass DENSE_ATTENTION_BYTES): on the 2-core CPU, SmolLM2's shapes (9 heads of 64,
# 3 kv heads), 1024 queries: 8K keys 1.68 -> 0.93 s per layer, 2K 0.41 -> 0.19 s, peak
# 886 -> 59 MiB. On GPU one call keeps the whole chunk in one kernel launch.
DENSE_ATTENTION_ROWS = 64
DENSE_ATTENTION_BYTES = 64 << 20


def dense_causal_attention(q, k, v, *, q_offset=0, scale=None, return_head_sum=False,
                           head_sum_rows=None):
    """q: [T, H, D], k: [L, H_kv, D], v: [L, H_kv, Dv] -> out [T, H, Dv].

    Query i at position q_offset + i sees keys j <= q_offset + i. Softmax in fp32.
    return_head_sum: also return p f32[T, L], the attention probabilities summed over the
    H heads and L1-normalised per query (the indexer's KL target), as (out, p).
    head_sum_rows: i32[R] (indices into the T queries; traced is fine): p only at those
    rows, f32[R, L] (a teacher cache keeps a few hundred rows of an 8K window, not 8K).
    """
    T, H, _ = q.shape
    rows = T
    if pallas_kernels.resolve("sparse_attention") == "xla":
        rows = pallas_kernels.rows_within(DENSE_ATTENTION_BYTES, 3 * 4 * H * k.shape[0],
                                          DENSE_ATTENTION_ROWS)
    result = pallas_kernels.map_query_rows(
        lambda first_row, qc: _attend_rows(qc, k, v, q_offset + first_row, scale,
                                           return_head_sum), rows, (q,))
    if not return_head_sum:
        return result
    out, p = result
    return out, (p if head_sum_rows is None else p[head_sum_rows])


def _attend_rows(q, k, v, q_offset, scale, head_sum):
    """dense_causal_attention of one chunk of queries: out, or (out, p) with p the head sum
    L1-normalised per query."""
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
    if not head_sum:
        return out
    p = jnp.sum(probs, axis=(1, 2))
    return out, p / jnp.sum(p, axis=-1, keepdims=True)


def select_tokens(config, layer, q_index, w_index, k_index, *, q_offset, summaries=None,
                  screen=None, key_ratio=1):
    """Layer `layer`'s top_k selection for queries at q_offset.. -> i32[T, top_k] (-1 padded):
    the selection kind config.layer_indexer(layer) names (indexer.selection), with the
    layer's settings (config.layer_settings). k_index: [L, d_I], the
    indexer-key cache up to a length bucket (positions past the queries are masked by
    causality); summaries: the cache's BlockSummaryCache of k_index; screen: the layer's
    trained coarse screen (indexer.ScreenParams) or None. key_ratio: positions each key
    summarises (DeepSeek-V4's CSA entries; indexer.selection), passed only when > 1."""
    kind = selection_kind(config.layer_indexer(layer), what="ModelConfig.indexer")
    ratio = {} if key_ratio == 1 else {"key_ratio": key_ratio}
    return kind.function(q_index, w_index, k_index, config.top_k, q_offset=q_offset,
                         config=config.layer_settings(layer),
                         summaries=summaries, screen=screen, **ratio)


class Attention(nnx.Module):
    """Grouped-query attention's projections + RoPE (the model's own and Llama-family
    checkpoints); the attention itself is one of two pure functions over the (keys, values)
    this module reads from the cache. model/mla.py is the other attention kind, with the
    same four members: project, read, output, scale; what each caches and how it is placed
    and counted is its entry in model.attention_kinds."""

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
