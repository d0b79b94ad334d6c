"""DeepSeek-V4's layers as nnx modules over the pure functions beside them: the attention of
a sliding, CSA or HCA layer (each its own attention kind, model.attention_kinds), the
compressors, and the hyper-connections that replace the residual sum.

A V4 attention runs its whole step over its own cache fields (model.cache; each module
below owns the fields it writes, as `FIELDS`):
- "window": the last sliding_window tokens' K = V as a ring (position p at row p % W), a
  constant per layer;
- "<kind>_entries": one row per `ratio` positions (model.cache_field.positions_per_row),
  and on CSA layers "csa_index_entries", the indexer's keys, with their block summaries
  ("csa_index_summary_*", a row per hierarchical.block_size entries);
- "<kind>_tail_kv" / "_tail_gate": a compressor's projections of the last `ratio` tokens
  (CSA: 2 x ratio, its overlap reads the window before) as a ring, so that a chunk or a
  decode step completes the window a previous call left open. An entry is written as soon
  as any of its tokens is seen, and rewritten until its window is whole; no query sees it
  before then.
Weights are stored as the checkpoints store them, [out, in] ("weight").
"""

import jax
import jax.numpy as jnp
from flax import nnx

from indexer.block_summaries import SUMMARY_LAYOUT, BlockSummaryCache, refresh
from indexer.rope import rope_angles
from model.attention import select_tokens
from model.deepseek_v4 import attention, compressor, csa, hyper_connections

# The CSA indexer's entry summaries, cache fields named this + indexer.block_summaries'
# fields: a row per block of hierarchical.block_size entries (the hierarchical selection's
# coarse stage reads them, as it reads a token cache's block summaries).
CSA_SUMMARY_PREFIX = "csa_index_summary_"


def _weight(rngs, shape, dtype):
    """An [out, in] matrix, lecun-normal over `in`."""
    return nnx.Param(nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)(
        rngs.params(), shape, dtype))


def _ring_read(ring, start, size):
    """Rows of positions start - size .. start - 1 of a ring holding position p at p % size."""
    return ring[(start - size + jnp.arange(size)) % size]


def _ring_write(ring, values, start, n_valid):
    """The ring after positions start .. start + n_valid - 1: values [size + T, ...] holds
    positions start - size .. start + T - 1 (the ring's rows first)."""
    size = ring.shape[0]
    last = jax.lax.dynamic_slice_in_dim(values, n_valid, size)  # start + n_valid - size ..
    rows = (start + n_valid - size + jnp.arange(size)) % size
    return ring.at[rows].set(last.astype(ring.dtype))


class Compressor(nnx.Module):
    """Pools windows of `ratio` tokens into entries of `head_dim` (model.deepseek_v4.
    compressor; overlap: CSA's form). Its tail (the ring of its last projections) lives in
    the layer's cache under `name`_tail_kv / _tail_gate."""

    def __init__(self, d_model, head_dim, ratio, overlap, *, rngs, param_dtype):
        width = head_dim * (2 if overlap else 1)
        self.ratio, self.overlap = ratio, overlap
        self.wkv = _weight(rngs, (width, d_model), param_dtype)
        self.wgate = _weight(rngs, (width, d_model), param_dtype)
        self.ape = nnx.Param(jnp.zeros((ratio, width), jnp.float32))
        self.norm = nnx.Param(jnp.ones((head_dim,), jnp.float32))

    @staticmethod
    def tail_rows(ratio, overlap):
        return ratio * (2 if overlap else 1)

    def __call__(self, h, tail_kv, tail_gate, start, n_valid, rope, norm_eps):
        """h [T, d_model] at positions start.. -> (entries [T // ratio + 1, head_dim] of the
        windows start // ratio.., the new tail_kv, tail_gate). The entries of windows not
        whole after n_valid tokens are provisional (their next call rewrites them)."""
        r, T = self.ratio, h.shape[0]
        size = tail_kv.shape[0]
        kv = h @ self.wkv[...].astype(h.dtype).T
        gate = h @ self.wgate[...].astype(h.dtype).T
        kv_all = jnp.concatenate([_ring_read(tail_kv, start, size).astype(kv.dtype), kv])
        gate_all = jnp.concatenate([_ring_read(tail_gate, start, size).astype(gate.dtype),
                                    gate])
        new_kv = _ring_write(tail_kv, kv_all, start, n_valid)
        new_gate = _ring_write(tail_gate, gate_all, start, n_valid)
        # The span from the first window this call touches (with CSA the window before it
        # too); padding past the call's tokens only ever fills provisional entries.
        windows = T // r + 1
        span = (windows + (1 if self.overlap else 0)) * r
        pad = ((0, span + size), (0, 0))
        kv_all, gate_all = jnp.pad(kv_all, pad), jnp.pad(gate_all, pad)
        first = start - start % r
        offset = first - (r if self.overlap else 0) - (start - size)
        kv_span = jax.lax.dynamic_slice_in_dim(kv_all, offset, span)
        gate_span = jax.lax.dynamic_slice_in_dim(gate_all, offset, span)
        ape = self.ape[...].astype(gate.dtype)
        prior = None
        if self.overlap:
            prior = compressor.last_window_prior(kv_span[:r], gate_span[:r], ape, ratio=r)
            kv_span, gate_span = kv_span[r:], gate_span[r:]
        entries = compressor.compress(kv_span, gate_span, ape, self.norm[...], rope, ratio=r,
                                      overlap=self.overlap, norm_eps=norm_eps,
                                      first_position=first, prior=prior)
        return entries, new_kv, new_gate


class CSAIndexer(nnx.Module):
    """The CSA layer's indexer (model.deepseek_v4.csa): its queries from the q-LoRA
    residual, head weights from the layer's input, keys from its own compressor."""

    def __init__(self, config, *, rngs, param_dtype):
        v4 = config.v4
        self.n_heads, self.head_dim = config.index_heads, config.index_dim
        self.wq_b = _weight(rngs, (self.n_heads * self.head_dim, v4.q_lora_rank), param_dtype)
        self.weights_proj = _weight(rngs, (self.n_heads, config.d_model), param_dtype)
        self.compressor = Compressor(config.d_model, self.head_dim, v4.csa_ratio, True,
                                     rngs=rngs, param_dtype=param_dtype)

    def queries(self, q_residual, x, cos, sin):
        return csa.index_queries(q_residual, self.wq_b[...].astype(x.dtype),
                                 self.weights_proj[...].astype(x.dtype), x, cos, sin,
                                 n_heads=self.n_heads, head_dim=self.head_dim)


class V4Attention(nnx.Module):
    """One V4 layer's attention (model.deepseek_v4.attention); KIND: "sliding", "csa" or
    "hca" (the subclasses below, one attention kind each)."""

    KIND = None

    def __init__(self, config, *, rngs, dtype, param_dtype):
        v4 = config.v4
        D, H, hd = config.d_model, config.n_heads, config.head_dim
        self.config, self.dtype = config, dtype
        self.wq_a = _weight(rngs, (v4.q_lora_rank, D), param_dtype)
        self.q_norm = nnx.Param(jnp.ones((v4.q_lora_rank,), jnp.float32))
        self.wq_b = _weight(rngs, (H * hd, v4.q_lora_rank), param_dtype)
        self.wkv = _weight(rngs, (hd, D), param_dtype)
        self.kv_norm = nnx.Param(jnp.ones((hd,), jnp.float32))
        self.sinks = nnx.Param(jnp.zeros((H,), jnp.float32))
        self.wo_a = _weight(rngs, (v4.o_groups * v4.o_lora_rank, H * hd // v4.o_groups),
                            param_dtype)
        self.wo_b = _weight(rngs, (D, v4.o_groups * v4.o_lora_rank), param_dtype)
        self.ratio = {"sliding": 0, "csa": v4.csa_ratio, "hca": v4.hca_ratio}[self.KIND]
        self.compressor = (Compressor(D, hd, self.ratio, self.KIND == "csa", rngs=rngs,
                                      param_dtype=param_dtype) if self.ratio else None)
        self.indexer = (CSAIndexer(config, rngs=rngs, param_dtype=param_dtype)
                        if self.KIND == "csa" else None)

    def rope(self, positions):
        """(cos, sin) of the layer's table: the main one on sliding layers, the compress
        one (with its YaRN) on compressed layers and their indexer."""
        c, v4 = self.config, self.config.v4
        if self.KIND == "sliding":
            return rope_angles(positions, v4.qk_rope_head_dim, theta=c.rope_theta)
        return rope_angles(positions, v4.qk_rope_head_dim, theta=v4.compress_rope_theta,
                           yarn=v4.compress_yarn)

    def __call__(self, x, cache, start, kv_len, n_valid=None, capture=(), *, layer):
        """x [T, d_model] (the normed layer input) at positions start.. -> (out [T, d_model],
        the layer's new cache, {"indices": the CSA entries each query attended (-1: none;
        all -1 on other kinds)} when captured). kv_len: positions the cache holds up to
        (static); n_valid: real tokens among the T (default T); layer: the layer's index
        (its selection kind and settings: ModelConfig.layer_indexer / layer_settings)."""
        c, v4 = self.config, self.config.v4
        T, W = x.shape[0], v4.sliding_window
        n_valid = T if n_valid is None else n_valid
        positions = start + jnp.arange(T)
        cos, sin = self.rope(positions)
        w = lambda p: p[...].astype(x.dtype)  # noqa: E731
        q, kv, q_residual = attention.project(x, w(self.wq_a), self.q_norm[...], w(self.wq_b),
                                              w(self.wkv), self.kv_norm[...], cos, sin,
                                              n_heads=c.n_heads, eps=c.norm_eps)
        window = cache.read("window")
        keys = jnp.concatenate([_ring_read(window, start, W).astype(kv.dtype), kv])
        new = {"window": _ring_write(window, keys, start, n_valid)}
        blocks = attention.window_blocks(keys, start, W)
        chosen = shared = own = None
        if self.ratio:
            name = self.KIND
            entries, new[f"{name}_tail_kv"], new[f"{name}_tail_gate"] = self.compressor(
                x, cache.read(f"{name}_tail_kv"), cache.read(f"{name}_tail_gate"), start,
                n_valid, self.rope, c.norm_eps)
            first_window = start // self.ratio
            cache = _write_entries(cache, f"{name}_entries", entries, first_window)
            stored = cache.read(f"{name}_entries")
            rows = -(-kv_len // self.ratio)
            if self.indexer is None or c.attention == "dense":  # every whole entry
                seen = compressor.visible_entries(positions, self.ratio)
                shared = (stored[:rows].astype(kv.dtype),
                          jnp.arange(rows)[None, :] < seen[:, None])
            if self.indexer is not None:
                index_entries, new["csa_index_tail_kv"], new["csa_index_tail_gate"] = \
                    self.indexer.compressor(x, cache.read("csa_index_tail_kv"),
                                            cache.read("csa_index_tail_gate"), start,
                                            n_valid, self.rope, c.norm_eps)
                cache = _write_entries(cache, "csa_index_entries", index_entries, first_window)
                index_keys = cache.read("csa_index_entries")
                # Summaries count whole entries only: a provisional one is rewritten later.
                cache = cache.update_summaries(
                    lambda sums, index: refresh(
                        sums, index_keys, first_window, index_entries.shape[0],
                        (start + n_valid) // self.ratio, block_size=c.hierarchical.block_size,
                        layer=index), prefix=CSA_SUMMARY_PREFIX)
                summaries = _summaries(cache)
                if c.attention == "sparse":
                    iq, iw = self.indexer.queries(q_residual, x, cos, sin)
                    chosen = select_tokens(c, layer, iq, iw, index_keys[:rows].astype(iq.dtype),
                                           q_offset=start, summaries=summaries,
                                           key_ratio=self.ratio)
                    own = (stored[jnp.maximum(chosen, 0)].astype(kv.dtype), chosen >= 0)
        out = attention.attend(q, self.sinks[...], blocks, shared, own)
        out = attention.output(out, cos, sin, w(self.wo_a), w(self.wo_b), groups=v4.o_groups)
        captured = {}
        if "indices" in capture:
            captured["indices"] = (chosen if chosen is not None
                                   else jnp.full((T, c.top_k), -1, jnp.int32))
        return out, cache.put(**new), captured


def _summaries(cache):
    return BlockSummaryCache(**{n: cache.read(CSA_SUMMARY_PREFIX + n) for n in SUMMARY_LAYOUT})


def _write_entries(cache, name, entries, first_window):
    """The layer's view (model.layer_cache.LayerView) with rows first_window.. of field
    `name` replaced by entries, in place; rows past the cache dropped (a chunk's
    provisional windows beyond its capacity)."""
    rows = first_window + jnp.arange(entries.shape[0])
    return cache.update(name, lambda stored, index: stored.at[index, rows].set(
        entries.astype(stored.dtype), mode="drop"))


class SlidingAttention(V4Attention):
    KIND = "sliding"


class CSAttention(V4Attention):
    KIND = "csa"


class HCAttention(V4Attention):
    KIND = "hca"


class HyperConnection(nnx.Module):
    """One hyper-connection (model.deepseek_v4.hyper_connections) around a sub-layer:
    `read` collapses the streams into its input, `write` puts its output back. head=True:
    the final collapse before the model's norm (read only)."""

    def __init__(self, config, *, rngs, head=False):
        v4 = config.v4
        N, D = v4.hc_mult, config.d_model
        rows = N if head else (2 + N) * N
        self.v4, self.norm_eps, self.head = v4, config.norm_eps, head
        self.fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (rows, N * D), jnp.float32))
        self.base = nnx.Param(jnp.zeros((rows,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((1 if head else 3,), jnp.float32))

    def read(self, streams):
        """streams [T, N, D] -> (the sub-layer's input [T, D], what `write` needs)."""
        v4 = self.v4
        if self.head:
            return hyper_connections.head_collapse(
                streams, self.fn[...], self.base[...], self.scale[...], hc_eps=v4.hc_eps,
                norm_eps=self.norm_eps), None
        pre, post, comb = hyper_connections.mix_weights(
            streams, self.fn[...], self.base[...], self.scale[...], hc_eps=v4.hc_eps,
            norm_eps=self.norm_eps, sinkhorn_iters=v4.hc_sinkhorn_iters)
        return hyper_connections.collapse(streams, pre), (post, comb)

    def write(self, streams, out, mixing):
        post, comb = mixing
        return hyper_connections.expand(out, streams, post, comb)
