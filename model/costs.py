"""What a dosa prefill computes, counted: FLOPs, bytes and top-k / sort work of each operation,
per layer and summed, plus the bytes per token of every cache and the context a device holds.

Pure arithmetic over a ModelConfig, no arrays. Each selection kind's own work comes from
its entry in the selection table (indexer.selection, counted in indexer.costs); this module
adds projections, attention, MLP and the head. The prefill is counted the way
model.runner.ModelRunner runs it: the chunks of model.buckets.chunk_plan. `skip` says
whether the kernels skip masked work (the Pallas kernels on GPU: index scores skip key tiles
in the future of a whole query tile, the fine stage skips invalid and future table columns,
sparse attention stops at a query's last valid index) or compute every masked entry (the jnp
references that run on CPU). serving's metrics report the indexer's share of these FLOPs;
experiments.costmodel turns the counts into seconds.
"""

import dataclasses

from indexer.costs import F32, Op, OpList, Selection, memory_op, visible_keys
from indexer.selection import selection_kind
from model.buckets import chunk_plan, length_bucket
from model.cache import layer_bytes_per_token

STAGES = ("other", "indexer", "attention")


def itemsize(config):
    return 2 if config.dtype == "bfloat16" else 4


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Main attention as the cost model sees it. kv_row: values per token and kv head read
    by attention (2 x head_dim for separate K and V; MLA's shared latent once). params: the
    attention projections' parameter count per layer."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    kv_row: int
    params: int
    label: str


def gqa_attention(config):
    """The model's own grouped-query attention."""
    c = config
    params = c.d_model * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + \
        c.n_heads * c.head_dim * c.d_model
    return AttentionShape(c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim, 2 * c.head_dim,
                          params, f"GQA {c.n_heads} heads / {c.n_kv_heads} kv heads x "
                          f"{c.head_dim}")


def model_selection(config, kind):
    return Selection(kind, config.index_heads, config.index_dim, config.top_k, itemsize(config),
                     config.hierarchical)


def selection_ops(s, T, p0, kv_len, skip):
    """Ops of one selection call (s: an indexer.costs.Selection): T queries at positions
    p0.., keys [0, kv_len); the kind's own count from the selection table."""
    return selection_kind(s.kind, what="selection kind").costs(s, T, p0, kv_len, skip)


def attention_ops(a, T, p0, kv_len, top_k, b, skip):
    """Sparse attention over top_k selected tokens per query, and dense causal attention
    (stage "dense_attention", for comparison: flash-style, K/V re-read per 128 queries)."""
    entries = visible_keys(p0, T, top_k) if skip else T * top_k
    qo = T * a.heads * (a.qk_dim + a.v_dim) * b
    pairs = visible_keys(p0, T, kv_len) if skip else T * kv_len
    kv = kv_len * a.kv_heads * a.kv_row * b
    return [Op("attention", "sparse attention", "sparse_attention",
               flops=2 * a.heads * (a.qk_dim + a.v_dim) * entries, bytes=qo + T * top_k * F32,
               gather_bytes=entries * a.kv_heads * a.kv_row * b, gather_source=kv),
            Op("dense_attention", "dense attention", "dense_attention",
               flops=2 * a.heads * (a.qk_dim + a.v_dim) * pairs,
               bytes=qo + kv * -(-T // 128))]


def _linear(name, params, d_in, d_out, T, b):
    return Op("other", name, "matmul", flops=2 * params * T,
              bytes=params * b + T * (d_in + d_out) * b)


def other_layer_ops(config, a, T, b, *, indexer=True):
    """Per layer: projections, MLP, norms, RoPE, residuals, cache writes, summary appends.
    The indexer's projections are here: linear in T, like every projection. indexer=False:
    a shared layer (indexer_types), which has no indexer and caches no index keys."""
    c = config
    idx_out = c.index_heads * c.index_dim + c.index_dim + c.index_heads if indexer else 0
    index_dim = c.index_dim if indexer else 0
    elementwise = T * b * (2 * 2 * c.d_model  # two RMSNorms, read + write
                           + 2 * a.heads * a.qk_dim + 2 * a.kv_heads * a.kv_row  # RoPE
                           + 2 * (c.index_heads + 2) * index_dim  # indexer RoPE, LayerNorm
                           + 3 * c.d_ff + 2 * 3 * c.d_model)  # SwiGLU, two residuals
    ops = [_linear("attention projections", a.params, c.d_model,
                   a.heads * (a.qk_dim + a.v_dim), T, b)]
    if indexer:
        ops.append(_linear("indexer projections", c.d_model * idx_out, c.d_model, idx_out,
                           T, b))
    return ops + [_linear("mlp", 3 * c.d_model * c.d_ff, c.d_model, 3 * c.d_ff, T, b),
                  memory_op("other", "elementwise", elementwise),
                  memory_op("other", "cache writes", T * (a.kv_heads * a.kv_row + index_dim) * b
                       + T * index_dim * (F32 * 4 + b))]


def head_ops(config, T, b):
    c = config
    return [memory_op("other", "embedding and final norm", T * c.d_model * b * 3),
            _linear("lm_head", c.d_model * c.vocab_size, c.d_model, c.vocab_size, T, b)]


SHARED = "shared"  # PrefillCounts' key of a layer that reuses another's selection


@dataclasses.dataclass
class PrefillCounts:
    """per_layer[kind]: one layer with that selection kind (or SHARED: no indexer), over the
    whole prefill; head: the embedding, final norm and lm_head; layers: each layer's key."""

    per_layer: dict
    head: OpList
    layers: tuple

    def total(self):
        out = OpList(self.head)
        for kind in self.layers:
            out.extend(self.per_layer[kind])
        return out


def prefill_counts(config, L, *, skip, indexer=None, attention=None, selections=None,
                   chunks=None):
    """Counts of a prefill of L tokens. indexer: a selection kind for every full layer
    (None: the config's per-layer choice, flat_index_layers included; shared layers of
    indexer_types select nothing either way). attention: an AttentionShape (default: the
    config's GQA). selections: {kind: Selection} overrides. chunks: [model.buckets.Chunk]
    (default: chunk_plan's chunks of config.prefill_chunk from position 0)."""
    a = attention or gqa_attention(config)
    b = itemsize(config)
    layers = tuple(SHARED if config.layer_is_shared(i) else indexer or config.layer_indexer(i)
                   for i in range(config.n_layers))
    sels = {kind: model_selection(config, kind) for kind in set(layers) - {SHARED}}
    sels.update(selections or {})
    if chunks is None:
        chunks = chunk_plan(L, start=0, capacity=length_bucket(L), chunk=config.prefill_chunk)
    per_layer = {kind: OpList() for kind in set(sels) | set(layers)}
    head = OpList()
    for ch in chunks:
        T = ch.padded
        attend = attention_ops(a, T, ch.position, ch.kv_len, config.top_k, b, skip)
        for kind in per_layer:
            if kind == SHARED:
                per_layer[kind].extend(other_layer_ops(config, a, T, b, indexer=False) + attend)
                continue
            per_layer[kind].extend(other_layer_ops(config, a, T, b) + attend).extend(
                selection_ops(sels[kind], T, ch.position, ch.kv_len, skip))
        head.extend(head_ops(config, T, b))
    return PrefillCounts(per_layer, head, layers)


def parameter_count(config, attention=None):
    """Weights of the model (with `attention`'s projections in place of the GQA ones)."""
    c = config
    a = attention or gqa_attention(config)
    indexer = c.d_model * (c.index_heads * c.index_dim + c.index_dim + c.index_heads) \
        + 2 * c.index_dim
    full = sum(not c.layer_is_shared(i) for i in range(c.n_layers))
    layer = 2 * c.d_model + a.params + 3 * c.d_model * c.d_ff
    return c.n_layers * layer + full * indexer + 2 * c.vocab_size * c.d_model + c.d_model


def cache_bytes_per_token(config, attention=None):
    """Bytes per token of a full layer's caches (model.cache): main-attention KV, indexer
    keys and block summaries; attention: an AttentionShape whose KV rows replace the
    model's (e.g. MLA's latent)."""
    per = layer_bytes_per_token(config, 0)
    if attention is not None:
        per["kv"] = attention.kv_heads * attention.kv_row * itemsize(config)
    return per


def max_context(memory_bytes, weight_bytes, per_token, n_layers, devices=1):
    """Longest context `devices` devices hold with weights replicated on each: the KV cache
    split over the devices (sequence parallel), indexer keys and block summaries on every
    device (each query scores all earlier keys). per_token: cache_bytes_per_token. Returns
    0 when the weights alone do not fit; activations and workspace are not counted."""
    free = memory_bytes - weight_bytes
    if free <= 0:
        return 0
    per = n_layers * (per_token["kv"] / devices + per_token["index_keys"]
                      + per_token["block_summaries"])
    return int(free // per)
