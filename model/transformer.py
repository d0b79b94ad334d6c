"""The DSA decoder block and the Transformer, run over a per-layer KV + indexer-key cache.

`Transformer.__call__` is the model's only layer walk. What training, evaluation and
benchmarks need from inside it is captured from that same pass (`capture=`), never
recomputed by a copy of it.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from indexer import BlockSummaryCache, CoarseScreen, LightningIndexer
from indexer.block_summaries import append as append_summaries
from indexer.block_summaries import empty_summaries, num_blocks
from model.attention import Attention, dense_causal_attention, select_tokens
from model.layers import RMSNorm, SwiGLU

# What a pass can capture, per layer, for the T queries of the call:
#   "indexer":          IndexerInputs(q [T, H_I, d_I], w f32[T, H_I], k [T, d_I]) - the
#                       indexer's outputs for the call's tokens (differentiable w.r.t. the
#                       indexer's parameters; its input is detached from the residual stream)
#   "attention_target": f32[T, kv_len], the dense attention probabilities summed over heads
#                       and L1-normalised per query (the indexer warm-up's KL target;
#                       attention="dense" only)
#   "indices":          i32[T, top_k], the tokens the sparse pass attended to (-1 = none;
#                       attention="sparse" only; all -1 in config.dense_layers, which
#                       attend to every visible token)
CAPTURE_KINDS = ("indexer", "attention_target", "indices")


class IndexerInputs(NamedTuple):
    q: jax.Array
    w: jax.Array
    k: jax.Array


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


def check_capture(config, capture):
    """capture as a sorted tuple (hashable, a static jit argument); ValueError on a kind
    that is unknown or that this config's attention does not produce."""
    capture = tuple(sorted(set(capture)))
    unknown = [c for c in capture if c not in CAPTURE_KINDS]
    if unknown:
        raise ValueError(f"capture: unknown kinds {unknown}; allowed: {list(CAPTURE_KINDS)}")
    if "attention_target" in capture and config.attention != "dense":
        raise ValueError("capture 'attention_target' needs attention='dense' "
                         f"(got attention={config.attention!r})")
    if "indices" in capture and config.attention != "sparse":
        raise ValueError("capture 'indices' needs attention='sparse' "
                         f"(got attention={config.attention!r})")
    return capture


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
        # The hierarchical indexer's learned coarse screen (HierarchicalConfig.coarse =
        # "learned"); present in every block, so run-time switches never change the graph.
        self.coarse_screen = CoarseScreen(config.index_heads, config.index_dim)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.d_ff, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache, start, kv_len, n_valid=None, capture=(), parallel=None):
        """x: [T, d_model] at positions start.. ; keys read from cache[:kv_len].

        Returns (x_out, new_cache, captured): captured maps each kind in `capture` (see
        CAPTURE_KINDS; checked by the Transformer) to this layer's value. kv_len is static;
        positions past start + T inside it hold stale or zero entries, which the causal
        mask hides. n_valid (traced is fine): only the first n_valid rows are real tokens
        (a padded prefill chunk); the rest are written to the key caches (later
        overwritten) but kept out of the block summaries. Default T. parallel: None, or a
        model.sequence_parallel.SequenceParallel whose sparse_attention replaces this
        layer's selection + sparse attention (a sequence-sharded cache; same results).
        """
        T = x.shape[0]
        positions = start + jnp.arange(T)
        h = self.attn_norm(x)
        q, k, v = self.attn.project(h, positions)
        # The indexer learns only from its own loss (DSA): its input is detached.
        q_index, w_index, k_index = self.indexer(jax.lax.stop_gradient(h), positions)
        if parallel is not None:  # every shard scores every key: all-gather the new ones
            k_index = parallel.replicate(k_index)
        k_index_cache = _write(cache.k_index, k_index, start)
        summaries = cache.summaries
        if summaries is not None:
            summaries = append_summaries(
                summaries, k_index, start, block_size=self.config.hierarchical.block_size,
                n_valid=n_valid, keys=k_index_cache)
        if parallel is None:
            k_cache, v_cache = _write(cache.k, k, start), _write(cache.v, v, start)
        else:  # the cache is split over positions: each shard writes its own rows
            k_cache, v_cache = parallel.write_kv(cache.k, cache.v, k, v, start)
        cache = LayerCache(k_cache, v_cache, k_index_cache, summaries)
        captured = {}
        if "indexer" in capture:
            captured["indexer"] = IndexerInputs(q_index, w_index, k_index)
        keys, values = cache.k[:kv_len], cache.v[:kv_len]
        if self.config.layer_is_sparse(self.layer) and parallel is not None:
            out, indices = parallel.sparse_attention(self.config, self.layer, q, q_index,
                                                     w_index, cache, start, kv_len,
                                                     screen=self.coarse_screen.params())
            if "indices" in capture:
                captured["indices"] = indices
        elif self.config.layer_is_sparse(self.layer):
            indices = select_tokens(self.config, q_index, w_index, cache.k_index[:kv_len],
                                    q_offset=start, summaries=summaries, layer=self.layer,
                                    screen=self.coarse_screen.params())
            out = pallas_kernels.sparse_attention(q, keys, values, indices)
            if "indices" in capture:
                captured["indices"] = indices
        elif "attention_target" in capture:
            out, p = dense_causal_attention(q, keys, values, q_offset=start,
                                            return_head_sum=True)
            captured["attention_target"] = jax.lax.stop_gradient(p)
        else:
            out = dense_causal_attention(q, keys, values, q_offset=start)
            if "indices" in capture:
                captured["indices"] = jnp.full((T, self.config.top_k), -1, jnp.int32)
        x = x + self.attn.output(out)
        x = x + self.mlp(self.mlp_norm(x))
        return x, cache, captured


def _block_call(block, x, cache, start, kv_len, n_valid, capture, parallel):
    return block(x, cache, start, kv_len, n_valid, capture, parallel)


# Rematerialised block for training memory: one block's activations alive at a time.
_remat_block_call = nnx.remat(_block_call, static_argnums=(4, 6, 7))


class Transformer(nnx.Module):
    def __init__(self, config, *, rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderBlock(config, layer=i, rngs=rngs)
                                for i in range(config.n_layers)])
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                                      dtype=dtype, kernel_init=nnx.initializers.lecun_normal(),
                                      rngs=rngs)

    def __call__(self, tokens, cache, start, kv_len, n_valid=None, *, capture=(), remat=False,
                 parallel=None):
        """tokens: i32[T] at positions start..start+T-1 -> (logits f32[T, V], new cache), or
        (logits, new cache, captured) when `capture` names kinds (CAPTURE_KINDS): captured
        maps each kind to a list over layers.

        n_valid: the first n_valid tokens are real, the rest padding (default T).
        remat: rematerialise each block in the backward pass (training memory).
        parallel: None, or a model.sequence_parallel.SequenceParallel (sharded prefill and
        decode over a mesh's sequence axis; see model.runner.ModelRunner(mesh=)).
        """
        kinds = check_capture(self.config, capture)
        call = _remat_block_call if remat else _block_call
        x = self.embed(tokens)
        new_cache = []
        captured = {kind: [] for kind in kinds}
        for layer, layer_cache in zip(self.layers, cache):
            x, layer_cache, layer_captured = call(layer, x, layer_cache, start, kv_len, n_valid,
                                                  kinds, parallel)
            new_cache.append(layer_cache)
            for kind in kinds:
                captured[kind].append(layer_captured[kind])
        h = self.final_norm(x)
        logits = (self.embed.attend(h) if self.config.tie_embeddings
                  else self.lm_head(h)).astype(jnp.float32)
        if kinds:
            return logits, new_cache, captured
        return logits, new_cache

    def forward(self, tokens, *, capture=(), remat=False):
        """Full-sequence logits f32[T, V] from scratch (training, evaluation); with
        `capture`, (logits, captured) as in __call__."""
        T = tokens.shape[0]
        out = self(tokens, init_cache(self.config, T), 0, T, capture=capture, remat=remat)
        return (out[0], out[2]) if capture else out[0]


def with_config(model, config):
    """The same weights under other run-time switches (attention, indexer, top_k,
    rope_scaling...): a Transformer sharing `model`'s parameter arrays."""
    other = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(other)
    _, state = nnx.split(model)
    return nnx.merge(graphdef, state)
