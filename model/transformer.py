"""The DSA decoder block and the Transformer, run over a per-layer KV + indexer-key cache."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from indexer import BlockSummaryCache, LightningIndexer
from indexer.block_summaries import append as append_summaries
from indexer.block_summaries import empty_summaries, num_blocks
from model.attention import Attention, attend, select_tokens
from model.layers import RMSNorm, SwiGLU


class LayerCache(NamedTuple):
    """One layer's cache, `capacity` positions long.

    k: [C, H_kv, D], v: [C, H_kv, D] (main attention), k_index: [C, d_I] (indexer keys),
    summaries: BlockSummaryCache of k_index in blocks of config.hierarchical.block_size
    (ceil(C / B) blocks), extended as keys are written (append-only: a cache reused from
    position p must hold exactly the tokens before p, see indexer.block_summaries.truncate);
    None: not maintained (the hierarchical indexer then rebuilds them from k_index).
    """

    k: jax.Array
    v: jax.Array
    k_index: jax.Array
    summaries: BlockSummaryCache | None = None


def init_cache(config, capacity):
    """Zeroed caches for every layer, `capacity` positions long."""
    dtype = jnp.dtype(config.dtype)
    shape_kv = (capacity, config.n_kv_heads, config.head_dim)
    n_blocks = num_blocks(capacity, config.hierarchical.block_size)
    return [LayerCache(jnp.zeros(shape_kv, dtype), jnp.zeros(shape_kv, dtype),
                       jnp.zeros((capacity, config.index_dim), dtype),
                       empty_summaries(n_blocks, config.index_dim))
            for _ in range(config.n_layers)]


def _write(cache_array, new, start):
    return jax.lax.dynamic_update_slice_in_dim(cache_array, new.astype(cache_array.dtype), start, 0)


class DecoderBlock(nnx.Module):
    """Pre-norm block: x + Attn(norm(x)) with DSA selection, then x + MLP(norm(x))."""

    def __init__(self, config, *, layer, rngs):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.layer = layer  # index in the stack, for config.flat_index_layers
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config, rngs=rngs, dtype=dtype)
        self.indexer = LightningIndexer(config.d_model, config.index_heads, config.index_dim,
                                        config.index_rope_dim, rope_theta=config.rope_theta,
                                        rope_scaling=config.indexer_rope_scaling, dtype=dtype,
                                        rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.d_ff, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache, start, kv_len, n_valid=None):
        """x: [T, d_model] at positions start.. ; keys read from cache[:kv_len].

        Returns (x_out, new_cache). kv_len is static; positions past start + T inside it hold
        stale or zero entries, which the causal mask hides. n_valid (traced is fine): only the
        first n_valid rows are real tokens (a padded prefill chunk); the rest are written to
        the key caches (later overwritten) but kept out of the block summaries. Default T.
        """
        T = x.shape[0]
        positions = start + jnp.arange(T)
        h = self.attn_norm(x)
        q, k, v = self.attn.project(h, positions)
        q_index, w_index, k_index = self.indexer(jax.lax.stop_gradient(h), positions)
        k_index_cache = _write(cache.k_index, k_index, start)
        summaries = cache.summaries
        if summaries is not None:
            summaries = append_summaries(
                summaries, k_index, start, block_size=self.config.hierarchical.block_size,
                n_valid=n_valid, keys=k_index_cache)
        cache = LayerCache(_write(cache.k, k, start), _write(cache.v, v, start), k_index_cache,
                           summaries)
        indices = None
        if self.config.attention == "sparse":
            indices = select_tokens(self.config, q_index, w_index, cache.k_index[:kv_len],
                                    q_offset=start, summaries=summaries, layer=self.layer)
        out = attend(q, cache.k[:kv_len], cache.v[:kv_len], indices, q_offset=start)
        x = x + self.attn.output(out)
        x = x + self.mlp(self.mlp_norm(x))
        return x, cache


class Transformer(nnx.Module):
    def __init__(self, config, *, rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderBlock(config, layer=i, rngs=rngs)
                                for i in range(config.n_layers)])
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, dtype=dtype,
                                  kernel_init=nnx.initializers.lecun_normal(), rngs=rngs)

    def __call__(self, tokens, cache, start, kv_len, n_valid=None):
        """tokens: i32[T] at positions start..start+T-1 -> (logits f32[T, V], new cache).

        n_valid: the first n_valid tokens are real, the rest padding (default T)."""
        x = self.embed(tokens)
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache):
            x, layer_cache = layer(x, layer_cache, start, kv_len, n_valid)
            new_cache.append(layer_cache)
        logits = self.lm_head(self.final_norm(x)).astype(jnp.float32)
        return logits, new_cache

    def forward(self, tokens):
        """Full-sequence logits f32[T, V] from scratch (training, evaluation)."""
        T = tokens.shape[0]
        logits, _ = self(tokens, init_cache(self.config, T), 0, T)
        return logits
