"""The DSA decoder block and the Transformer, run over a KV + indexer-key cache.

`Transformer.__call__` is the model's only layer walk: the layers' parameters and caches
are stacked (model.layer_stack) and each segment of alike layers runs as one scan, so a
step compiles one layer body per segment whatever the depth (model.layer_scan). What
training, evaluation and benchmarks need from inside it is captured from that same pass
(`capture=`), never recomputed by a copy of it.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from indexer.module import CoarseScreen, LightningIndexer
from indexer.selection import selection_kind
from model.attention import dense_causal_attention, select_tokens
from model.attention_kinds import attention_kind
from model.cache import init_cache, token_rows, write_index
from model.deepseek_v4.modules import HyperConnection
from model.layer_scan import run_layers
from model.layer_stack import (
    from_layered,
    layer_plan,
    layer_slice,
    stack_trees,
    to_layered,
)
from model.layers import RMSNorm, SwiGLU
from model.moe import MoE

# What a pass can capture, per layer, for the T queries of the call:
#   "indexer":          IndexerInputs(q [T, H_I, d_I], w f32[T, H_I], k [T, d_I]) - the
#                       indexer's outputs for the call's tokens (differentiable w.r.t. the
#                       indexer's parameters; its input is detached from the residual stream);
#                       on a shared layer (indexer_types) those of the full layer whose
#                       selection it attends to, so a KL on it trains that indexer for both
#   "indexer_input":    IndexerSource(hidden [T, d_model], query_hidden [T, q_dim] or None),
#                       what the layer's indexer reads (detached); on a shared layer, what
#                       the full layer whose selection it attends to read. With the
#                       "attention_target" rows this is all a teacher cache needs to train
#                       the indexer without running the model again
#                       (experiments.training.teacher)
#   "attention_target": f32[T, kv_len], the dense attention probabilities summed over heads
#                       and L1-normalised per query (the indexer warm-up's KL target;
#                       attention="dense" only); f32[R, kv_len] at the R rows of
#                       `capture_rows` when the pass is given them
#   "indices":          i32[T, top_k], the tokens the sparse pass attended to (-1 = none;
#                       attention="sparse" only; all -1 in config.dense_layers, which
#                       attend to every visible token); DeepSeek-V4: the compressed
#                       entries a CSA layer attended to (all -1 on its other layers)
CAPTURE_KINDS = ("indexer", "indexer_input", "attention_target", "indices")


class IndexerInputs(NamedTuple):
    q: jax.Array
    w: jax.Array
    k: jax.Array


class IndexerSource(NamedTuple):
    hidden: jax.Array
    query_hidden: jax.Array | None


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
    other = [c for c in capture if c != "indices"]
    if config.v4 is not None and other:
        raise ValueError(f"capture {other}: a DeepSeek-V4 model captures 'indices' only (its "
                         "CSA indexer scores compressed entries, not tokens)")
    return capture


class DecoderBlock(nnx.Module):
    """Pre-norm block: x + Attn(norm(x)) with DSA selection, then x + MLP(norm(x)).

    A layer that is "shared" in config.indexer_types has no indexer (and no coarse screen):
    it attends to the selection the nearest earlier full layer hands it. DeepSeek-V4
    (config.v4): x is hc_mult streams [T, N, d_model] and each sum is a hyper-connection
    (attn_hc, mlp_hc); its attention kinds run their own indexer (self_indexed).

    `layer` fixes the block's structure (model.layer_stack.structure_key); a call names the
    layer it runs as, whose per-layer switches (selection kind, budget, dense or sparse)
    it reads: the Transformer stores one block per stack, with a leading layer axis."""

    def __init__(self, config, *, layer, rngs):
        dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        self.config = config
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        # The layer's attention kind (model.attention_kinds: GQA, MLA for V3.2 / GLM-5, or
        # V4's sliding / CSA / HCA), over the cache fields its entry names.
        kind = attention_kind(config, layer)
        self.self_indexed = kind.self_indexed
        self.attn = kind.module(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        v4 = config.v4 is not None
        self.attn_hc = HyperConnection(config, rngs=rngs) if v4 else None
        self.mlp_hc = HyperConnection(config, rngs=rngs) if v4 else None
        if config.layer_is_shared(layer) or kind.self_indexed:
            self.indexer = self.coarse_screen = None
        else:
            # The indexer's query input is the kind's (V3.2: MLA's q-LoRA residual).
            self.indexer = LightningIndexer(
                config.d_model, config.index_heads, config.index_dim, config.index_rope_dim,
                rope_theta=config.rope_theta, rope_scaling=config.indexer_rope_scaling,
                dtype=dtype, param_dtype=param_dtype, rngs=rngs, yarn=config.yarn,
                q_dim=kind.indexer_query_dim(config),
                rope_interleaved=config.index_rope_interleaved)
            # The hierarchical indexer's learned coarse screen (HierarchicalConfig.coarse =
            # "learned"); in every full block, so run-time switches never change the graph.
            self.coarse_screen = CoarseScreen(config.index_heads, config.index_dim)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        if config.layer_is_moe(layer):
            self.mlp = MoE(config.d_model, config.moe, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs, hash_vocab=config.vocab_size
                           if config.layer_is_hashed(layer) else None)
        else:
            self.mlp = SwiGLU(config.d_model, config.d_ff, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)

    def __call__(self, x, cache, start, kv_len, n_valid=None, capture=(), parallel=None,
                 handoff=None, capture_rows=None, tokens=None, *, layer, stack_index=None):
        """x: [T, d_model] (V4: [T, hc_mult, d_model]) at positions start.. ; cache: the
        layer's model.layer_cache.LayerView, keys read up to kv_len; tokens: i32[T], the ids
        (a hash-routed MoE reads them); layer: the layer this call runs (static), whose
        per-layer switches apply; stack_index: None, or the layer's index in its stack when
        the block's routed experts are the whole stack (model.layer_scan: read in place).

        Returns (x_out, the view after its writes, captured, handoff): captured maps each
        kind in `capture` (see CAPTURE_KINDS; checked by the Transformer) to this layer's
        value; handoff is (IndexerInputs, indices or None, IndexerSource) of the selection
        this layer attended to, which the following shared layers reuse (the `handoff`
        argument: ignored by a full layer). capture_rows: None, or i32[R] rows of the T
        queries at which "attention_target" is captured.
        kv_len is static; positions past start + T inside it hold stale or zero entries,
        which the causal mask hides. n_valid (traced is fine): only the first n_valid rows
        are real tokens (a padded prefill chunk); the rest are written to the key caches
        (later overwritten) but kept out of the block summaries. Default T. parallel: None,
        or a model.sequence_parallel.SequenceParallel (a sequence-sharded cache: its
        selection and sparse attention replace this layer's; same results).
        """
        h, mixing = (x, None) if self.attn_hc is None else self.attn_hc.read(x)
        h = self.attn_norm(h)
        if self.self_indexed:
            if parallel is not None:
                raise ValueError("a sequence-sharded cache (mesh sequence axis > 1) does not "
                                 "run DeepSeek-V4's attention yet")
            out, cache, captured = self.attn(h, cache, start, kv_len, n_valid, capture,
                                             layer=layer)
        else:
            out, cache, captured, handoff = self._dsa_attention(
                h, cache, start, kv_len, n_valid, capture, parallel, handoff, capture_rows,
                layer)
        x = x + out if self.attn_hc is None else self.attn_hc.write(x, out, mixing)
        h, mixing = (x, None) if self.mlp_hc is None else self.mlp_hc.read(x)
        h = self.mlp_norm(h)
        out = (self.mlp(h, tokens, layer=stack_index) if isinstance(self.mlp, MoE)
               else self.mlp(h))
        x = x + out if self.mlp_hc is None else self.mlp_hc.write(x, out, mixing)
        return x, cache, captured, handoff

    def _dsa_attention(self, h, cache, start, kv_len, n_valid, capture, parallel, handoff,
                       capture_rows, layer):
        """The DSA layer's attention of the normed input h [T, d_model]: its indexer, the
        selection and the sparse (or dense) read -> (out [T, d_model], cache, captured,
        handoff)."""
        config = self.config
        T = h.shape[0]
        positions = start + jnp.arange(T)
        # A kind that ranks the attention itself (the oracle) selects once the layer has
        # read its keys, not from the indexer.
        oracle = selection_kind(config.layer_indexer(layer)).scores == "attention"
        if oracle and parallel is not None:
            raise ValueError(f"ModelConfig.indexer {config.layer_indexer(layer)!r} ranks "
                             "dense attention and runs on one device only (no sequence axis)")
        q, rows, index_query = self.attn.project(h, positions)
        names = tuple(rows)
        if cache.pages is not None:  # a paged view: the new rows go back after the step
            cache = cache.put(**rows)
        elif parallel is None:
            for n, r in rows.items():
                cache = cache.write_rows(n, r, start)
        else:  # the cache is split over positions: each shard writes its own rows
            cache = parallel.write_rows(cache, rows, start)
        if self.indexer is None:
            inputs, indices, source = handoff
        else:
            # The indexer learns only from its own loss (DSA): its input is detached.
            source = IndexerSource(jax.lax.stop_gradient(h), None if index_query is None
                                   else jax.lax.stop_gradient(index_query))
            inputs = IndexerInputs(*self.indexer(source.hidden, positions,
                                                 query_hidden=source.query_hidden))
            if parallel is not None:  # every shard scores every key: all-gather the new ones
                inputs = inputs._replace(k=parallel.replicate(inputs.k))
            cache = write_index(cache, inputs.k, start,
                                block_size=config.hierarchical.block_size, n_valid=n_valid)
            indices = None
            if config.layer_needs_selection(layer) and not oracle:
                select = select_tokens if parallel is None else parallel.select
                indices = select(config, layer, inputs.q, inputs.w,
                                 cache.k_index[:kv_len], q_offset=start,
                                 summaries=cache.summaries, screen=self.coarse_screen.params())
        captured = {}
        if "indexer" in capture:
            captured["indexer"] = inputs
        if "indexer_input" in capture:
            captured["indexer_input"] = source
        scale = self.attn.scale
        if config.layer_is_sparse(layer):
            if cache.pages is not None and not oracle:  # only the selected rows, by page
                selected, local = cache.pages.selected(cache, names, indices)
                keys, values = self.attn.read(selected)
                out = pallas_kernels.sparse_attention(q, keys, values, local, scale=scale)
            elif parallel is None:
                keys, values = self.attn.read(token_rows(cache, names, kv_len))
                if oracle and self.indexer is not None:
                    # The oracle ranks this layer's own dense attention (its output unused).
                    _, target = dense_causal_attention(q, keys, values, q_offset=start,
                                                       scale=scale, return_head_sum=True)
                    indices = selection_kind(config.layer_indexer(layer)).function(
                        target, config.top_k, q_offset=start)
                out = pallas_kernels.sparse_attention(q, keys, values, indices, scale=scale)
            else:
                out = parallel.sparse_attention(q, token_rows(cache, names, None),
                                                self.attn.read, indices, scale=scale)
            if "indices" in capture:
                captured["indices"] = indices
        else:
            keys, values = self.attn.read(token_rows(cache, names, kv_len))
            if "attention_target" in capture:
                out, p = dense_causal_attention(q, keys, values, q_offset=start, scale=scale,
                                                return_head_sum=True, head_sum_rows=capture_rows)
                captured["attention_target"] = jax.lax.stop_gradient(p)
            else:
                out = dense_causal_attention(q, keys, values, q_offset=start, scale=scale)
            if "indices" in capture:
                captured["indices"] = jnp.full((T, config.top_k), -1, jnp.int32)
        return self.attn.output(out), cache, captured, (inputs, indices, source)


class Transformer(nnx.Module):
    """Embedding, the decoder layers stored as stacks (`stacks[s]`: one DecoderBlock whose
    parameters carry a leading axis over the layers of stack s, model.layer_stack), the
    final norm and head. `layer(i)` is a copy of layer i's block; `set_layer(i, block)`
    writes one back."""

    def __init__(self, config, *, rngs):
        self.config = config
        dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
        # Built layer by layer (the random draws of an unstacked model), then stacked.
        blocks = [DecoderBlock(config, layer=i, rngs=rngs) for i in range(config.n_layers)]
        self.stacks = nnx.List([_stacked([blocks[i] for i in layers])
                                for layers in layer_plan(config).stacks])
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        # DeepSeek-V4: the streams' final collapse before the norm
        self.hc_head = (HyperConnection(config, rngs=rngs, head=True)
                        if config.v4 is not None else None)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                                      dtype=dtype, param_dtype=param_dtype,
                                      kernel_init=nnx.initializers.lecun_normal(), rngs=rngs)

    def layer(self, i):
        """Layer i's DecoderBlock with its own parameters (copies: to read or run one layer;
        writes go through set_layer)."""
        s, index = layer_plan(self.config).place[i]
        graphdef, state = nnx.split(self.stacks[s])
        return nnx.merge(graphdef, layer_slice(state, index))

    def set_layer(self, i, block):
        """Writes `block`'s variables (a DecoderBlock of layer i's structure, e.g. layer(i)
        changed) into layer i of its stack."""
        s, index = layer_plan(self.config).place[i]
        stacked = dict(nnx.to_flat_state(nnx.state(self.stacks[s])))
        for path, variable in nnx.to_flat_state(nnx.state(block)):
            target = stacked[path]
            target.set_value(target.get_value().at[index].set(
                variable.get_value().astype(target.get_value().dtype)))

    def __call__(self, tokens, cache, start, kv_len, n_valid=None, *, capture=(), remat=False,
                 parallel=None, capture_rows=None):
        """tokens: i32[T] at positions start..start+T-1 -> (logits f32[T, V], new cache), or
        (logits, new cache, captured) when `capture` names kinds (CAPTURE_KINDS): captured
        maps each kind to a list over layers.

        cache: model.cache.init_cache's list over the stacks. n_valid: the first n_valid
        tokens are real, the rest padding (default T). remat: rematerialise each segment's
        unit of layers in the backward pass (training memory). capture_rows: None, or i32[R]
        rows of the T queries: "attention_target" only there. parallel: None, or a
        model.sequence_parallel.SequenceParallel (sharded prefill and decode over a mesh's
        sequence axis; see model.runner.ModelRunner(mesh=)).
        """
        kinds = check_capture(self.config, capture)
        x = self.embed(tokens)
        if self.hc_head is not None:  # V4: the embedding starts every stream
            x = jnp.repeat(x[:, None, :], self.config.v4.hc_mult, axis=1)
        x, new_cache, captured = run_layers(
            self.config, [nnx.split(stack) for stack in self.stacks], x, list(cache),
            dict(start=start, kv_len=kv_len, n_valid=n_valid, capture=kinds,
                 parallel=parallel, capture_rows=capture_rows, tokens=tokens), remat=remat)
        h = self.final_norm(x if self.hc_head is None else self.hc_head.read(x)[0])
        logits = (self.embed.attend(h) if self.config.tie_embeddings
                  else self.lm_head(h)).astype(jnp.float32)
        if kinds:
            return logits, new_cache, captured
        return logits, new_cache

    def forward(self, tokens, *, capture=(), remat=False, capture_rows=None):
        """Full-sequence logits f32[T, V] from scratch (training, evaluation); with
        `capture`, (logits, captured) as in __call__."""
        T = tokens.shape[0]
        out = self(tokens, init_cache(self.config, T), 0, T, capture=capture, remat=remat,
                   capture_rows=capture_rows)
        return (out[0], out[2]) if capture else out[0]


def _stacked(blocks):
    """One DecoderBlock of the blocks' structure whose variables stack theirs."""
    graphdef, _ = nnx.split(blocks[0])
    return nnx.merge(graphdef, stack_trees([nnx.split(b)[1] for b in blocks]))


def with_config(model, config):
    """The same weights under other run-time switches (attention, indexer, top_k,
    rope_scaling, indexer_types...): a Transformer sharing `model`'s parameter arrays
    (when the switches leave the stacks of model.layer_stack as they are; a change of
    indexer_types restacks the layers: copies).

    Making a layer "shared" drops its indexer (and coarse screen); making a shared layer
    full needs indexer weights `model` does not have: ValueError naming them."""
    other = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, wanted = nnx.split(other)
    wanted = dict(nnx.to_flat_state(wanted))
    have = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(model))}
    restack = layer_plan(config).stacks != layer_plan(model.config).stacks
    if restack:  # per layer, then stacked as `config` stacks them
        have = to_layered(have, model.config)
    needed = to_layered(dict.fromkeys(wanted), config, keys_only=True) if restack else wanted
    missing = [path for path in needed if path not in have]
    if missing:
        names = sorted({"/".join(map(str, path[:3])) for path in
                        (to_layered(dict.fromkeys(missing), config, keys_only=True)
                         if not restack else missing)})
        raise ValueError(f"with_config: the new config needs weights the model does not have "
                         f"({names}): a layer that is shared in the model's indexer_types "
                         "has no indexer to run")
    if restack:
        have = from_layered({path: have[path] for path in needed}, config)
    return nnx.merge(graphdef, nnx.from_flat_state(
        [(path, variable.replace(have[path])) for path, variable in wanted.items()]))
