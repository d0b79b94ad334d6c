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
import math

from indexer.costs import F32, Op, OpList, Selection, memory_op, visible_keys
from indexer.selection import selection_kind
from model.attention_kinds import attention_kind
from model.buckets import chunk_plan, length_bucket
from model.cache import bytes_per_token, layer_bytes_per_token
from model.deepseek_v4.costs import v4_attention_ops, v4_shape

STAGES = ("other", "indexer", "attention")


def itemsize(config):
    return 2 if config.dtype == "bfloat16" else 4


def expert_weight_bytes(config):
    """Bytes per routed-expert parameter: the model's dtype, or float8 plus one float32
    scale per block when the experts are kept in FP8 (MoEConfig.fp8_block)."""
    block = getattr(config.moe, "fp8_block", ()) if config.moe is not None else ()
    return 1.0 + F32 / (block[0] * block[1]) if block else float(itemsize(config))


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Main attention as the cost model sees it. kv_row: values per token and kv head read
    by attention (2 x head_dim for separate K and V; MLA's shared latent once). params: the
    attention projections' parameter count per layer. expand_params: parameters applied to
    every read cache row before attending (MLA's kv_b in the expanded form; 0: none).
    cache_row: values cached per token (None: kv_heads x kv_row). rope: values RoPE reads
    and writes per token (None: every query and key dim, 2 x heads x qk_dim + 2 x kv_heads
    x kv_row). norm_params: the kind's own norms' parameters per layer (MLA's latent
    RMSNorms)."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    kv_row: int
    params: int
    label: str
    expand_params: int = 0
    cache_row: int | None = None
    rope: int | None = None
    norm_params: int = 0
    # DeepSeek-V4 (model/deepseek_v4/costs.py): the window every query reads, positions per
    # compressed entry, which entries it reads ("selected": top_k; "all"), and the
    # projections of the kind's own indexer (CSA's).
    window: int = 0
    entry_ratio: int = 0
    reads_entries: str = ""
    own_index_params: int = 0

    @property
    def cached(self):
        return self.kv_heads * self.kv_row if self.cache_row is None else self.cache_row


def gqa_attention(config):
    """The model's own grouped-query attention."""
    c = config
    params = c.d_model * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + \
        c.n_heads * c.head_dim * c.d_model
    return AttentionShape(c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim, 2 * c.head_dim,
                          params, f"GQA {c.n_heads} heads / {c.n_kv_heads} kv heads x "
                          f"{c.head_dim}")


def mla_attention(config):
    """MLA (model/mla.py) as the config runs it. Projections q_a, q_b, kv_a, kv_b, o (kv_b
    folded into the queries and the output when absorbed: the same FLOPs per token as its
    parameters). Absorbed: MQA over the latent, one key of kv_lora_rank + qk_rope_head_dim
    per token shared by every head, values over the kv_lora_rank dims (576 / 512 for V3.2).
    Expanded: kv_b turns every read latent row into each head's [k_nope | v] first."""
    c, m = config, config.mla
    H, lat = c.n_heads, m.latent_dim
    kv_b = m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
    params = (c.d_model * m.q_lora_rank + m.q_lora_rank * H * m.qk_head_dim
              + c.d_model * lat + kv_b + H * m.v_head_dim * c.d_model)
    # RoPE on the rotary dims of q and the shared key, and the two latent RMSNorms.
    own = dict(rope=2 * (H + 1) * m.qk_rope_head_dim + 2 * (m.q_lora_rank + m.kv_lora_rank),
               norm_params=m.q_lora_rank + m.kv_lora_rank)
    if m.absorb:
        return AttentionShape(H, 1, lat, m.kv_lora_rank, lat, params,
                              f"MLA absorbed (MQA over the latent), {H} heads, latent "
                              f"{m.kv_lora_rank}+{m.qk_rope_head_dim}", **own)
    return AttentionShape(H, H, m.qk_head_dim, m.v_head_dim, m.qk_head_dim + m.v_head_dim,
                          params, f"MLA expanded, {H} heads x {m.qk_head_dim}",
                          expand_params=kv_b, cache_row=lat, **own)


def _v4(kind):
    return lambda config: AttentionShape(**v4_shape(config, kind))


# Each attention kind's cost entry (model.attention_kinds): config -> its AttentionShape.
ATTENTION_COSTS = {"gqa": gqa_attention, "mla": mla_attention,
                   **{kind: _v4(kind) for kind in ("sliding", "csa", "hca")}}


def countable(config):
    """Whether every layer's attention kind has a cost entry."""
    return all(attention_kind(config, layer).name in ATTENTION_COSTS
               for layer in range(config.n_layers))


def attention_shape(config, layer=0):
    """Layer `layer`'s attention, as its kind's cost entry counts it."""
    name = attention_kind(config, layer).name
    if name not in ATTENTION_COSTS:
        raise ValueError(f"the cost model has no entry for attention kind {name!r}")
    return ATTENTION_COSTS[name](config)


def model_selection(config, kind, key_ratio=1):
    return Selection(kind, config.index_heads, config.index_dim, config.top_k, itemsize(config),
                     config.settings(kind), key_ratio=key_ratio)


def selection_ops(s, T, p0, kv_len, skip):
    """Ops of one selection call (s: an indexer.costs.Selection): T queries at positions
    p0.., keys [0, kv_len); the kind's own count from the selection table."""
    return selection_kind(s.kind, what="selection kind").costs(s, T, p0, kv_len, skip)


def attention_ops(a, T, p0, kv_len, top_k, b, skip):
    """Sparse attention over top_k selected tokens per query, and dense causal attention
    (stage "dense_attention", for comparison: flash-style, K/V re-read per 128 queries).
    An expanded MLA first expands every read latent row (a.expand_params), in both.
    DeepSeek-V4's kinds: their window and entries (model.deepseek_v4.costs)."""
    if a.window:
        return v4_attention_ops(a, T, p0, kv_len, top_k, b, skip)
    entries = visible_keys(p0, T, top_k) if skip else T * top_k
    qo = T * a.heads * (a.qk_dim + a.v_dim) * b
    pairs = visible_keys(p0, T, kv_len) if skip else T * kv_len
    kv = kv_len * a.kv_heads * a.kv_row * b
    ops = [Op("attention", "sparse attention", "sparse_attention",
              flops=2 * a.heads * (a.qk_dim + a.v_dim) * entries, bytes=qo + T * top_k * F32,
              gather_bytes=entries * a.kv_heads * a.kv_row * b, gather_source=kv),
           Op("dense_attention", "dense attention", "dense_attention",
              flops=2 * a.heads * (a.qk_dim + a.v_dim) * pairs,
              bytes=qo + kv * -(-T // 128))]
    if a.expand_params:
        for stage in ("attention", "dense_attention"):
            ops.append(Op(stage, "expand latent", "matmul", flops=2 * a.expand_params * kv_len,
                          bytes=kv_len * (a.cached + a.kv_heads * a.kv_row) * b))
    return ops


def _linear(name, params, d_in, d_out, T, b, weight_bytes=None):
    wb = b if weight_bytes is None else weight_bytes
    return Op("other", name, "matmul", flops=2 * params * T,
              bytes=params * wb + T * (d_in + d_out) * b)


def indexer_params(config):
    """The indexer's projection parameters: wq (from the q-LoRA residual under MLA, as V3.2
    and GLM-5 run it: wq_b), wk and the head weights, all from x otherwise."""
    c = config
    q_in = attention_kind(c).indexer_query_dim(c) or c.d_model
    return q_in * c.index_heads * c.index_dim + c.d_model * (c.index_dim + c.index_heads)


def experts_touched(E, k, T):
    """Expected distinct experts a chunk of T tokens routes to, k of E each (uniform
    routing): the experts whose weights the chunk reads."""
    return E * (1.0 - (1.0 - k / E) ** T)


def mlp_ops(config, T, b, *, moe=False):
    """The feed-forward of one layer: the dense SwiGLU, or DeepSeekMoE as model/moe.py
    runs it (float32 router, the top-k choice, the assignments sorted by expert, the chosen
    experts through ragged_dot, gathered rows and their weighted scatter-back, the shared
    experts on every token)."""
    c = config
    if not moe:
        return [_linear("mlp", 3 * c.d_model * c.d_ff, c.d_model, 3 * c.d_ff, T, b)]
    m, D = c.moe, c.d_model
    E, k, F = m.n_routed_experts, m.num_experts_per_tok, m.moe_intermediate_size
    assignments = T * k
    ops = [Op("other", "router", "matmul", flops=2 * D * E * T,
              bytes=E * D * F32 + T * D * b + T * E * F32 * 3),
           Op("other", "expert choice", "topk", rows=T, elements=T * E, k=k),
           Op("other", "expert dispatch sort", "sort", elements=assignments,
              sort_work=assignments * math.log2(max(assignments, 2))),
           Op("other", "routed experts", "matmul", flops=2 * 3 * D * F * assignments,
              bytes=experts_touched(E, k, T) * 3 * D * F * expert_weight_bytes(c)
              + assignments * (2 * D + 3 * F) * b),
           memory_op("other", "expert gather and combine", assignments * D * b * 4
                     + T * D * b * 2)]
    if m.n_shared_experts:
        S = F * m.n_shared_experts
        ops.append(_linear("shared experts", 3 * D * S, D, 3 * S, T, b))
    return ops


def mlp_hidden(config, layer_moe):
    """Hidden width of a layer's SwiGLU activations per token (routed + shared for MoE)."""
    if not layer_moe:
        return config.d_ff
    m = config.moe
    return (m.num_experts_per_tok + m.n_shared_experts) * m.moe_intermediate_size


def other_layer_ops(config, a, T, b, *, indexer=True, moe=False):
    """Per layer: projections, MLP (moe: the MoE), norms, RoPE, residuals, cache writes,
    summary appends. The indexer's projections are here: linear in T, like every projection.
    indexer=False: a shared layer (indexer_types), which has no indexer and caches no index
    keys."""
    c = config
    idx_out = c.index_heads * c.index_dim + c.index_dim + c.index_heads if indexer else 0
    index_dim = c.index_dim if indexer else 0
    rope = 2 * a.heads * a.qk_dim + 2 * a.kv_heads * a.kv_row if a.rope is None else a.rope
    elementwise = T * b * (2 * 2 * c.d_model  # two RMSNorms, read + write
                           + rope
                           + 2 * (c.index_heads + 2) * index_dim  # indexer RoPE, LayerNorm
                           + 3 * mlp_hidden(c, moe) + 2 * 3 * c.d_model)  # SwiGLU, residuals
    ops = [_linear("attention projections", a.params, c.d_model,
                   a.heads * (a.qk_dim + a.v_dim), T, b)]
    if indexer:
        ops.append(_linear("indexer projections", indexer_params(c), c.d_model, idx_out, T, b))
    if a.own_index_params:
        ops.append(_linear("indexer projections", a.own_index_params, c.d_model,
                           c.index_heads * c.index_dim, T, b))
    if c.v4 is not None:  # two hyper-connections: the mixing weights from the N streams
        N = c.v4.hc_mult
        ops.append(_linear("hyper-connections", 2 * hc_params(c), N * c.d_model,
                           (2 + N) * N, T, b))
    return ops + mlp_ops(c, T, b, moe=moe) + [
        memory_op("other", "elementwise", elementwise),
        memory_op("other", "cache writes", T * (a.cached + index_dim) * b
                  + T * index_dim * (F32 * 4 + b))]


def hc_params(config):
    """One hyper-connection's mixing weights (DeepSeek-V4): [(2 + N) N, N d_model]."""
    N = config.v4.hc_mult
    return (2 + N) * N * N * config.d_model


def head_ops(config, T, b):
    c = config
    ops = [memory_op("other", "embedding and final norm", T * c.d_model * b * 3),
           _linear("lm_head", c.d_model * c.vocab_size, c.d_model, c.vocab_size, T, b)]
    if c.v4 is not None:  # the streams' last collapse
        N = c.v4.hc_mult
        ops.append(_linear("hyper-connections", N * N * c.d_model, N * c.d_model, N, T, b))
    return ops


SHARED = "shared"  # PrefillCounts' key of a layer that reuses another's selection
MOE = "+moe"  # suffix of the key of a layer whose feed-forward is the MoE


@dataclasses.dataclass
class PrefillCounts:
    """per_layer[key]: one layer of that key over the whole prefill, the key being its
    selection kind (or SHARED: no indexer), + MOE when its feed-forward is the MoE; head:
    the embedding, final norm and lm_head; layers: each layer's key."""

    per_layer: dict
    head: OpList
    layers: tuple

    def total(self):
        out = OpList(self.head)
        for key in self.layers:
            out.extend(self.per_layer[key])
        return out

    def layer(self, kind):
        """One layer with selection `kind`: its MoE form when the model has MoE layers."""
        return self.per_layer.get(kind + MOE, self.per_layer.get(kind))


def layer_key(config, layer, indexer=None):
    """The selection kind of the layer (SHARED: none), "+moe" for an MoE feed-forward; a
    model with several attention kinds (DeepSeek-V4) prefixes the layer's, "csa/flat",
    and its layers that do not select are just their kind, "hca"."""
    kind = SHARED if config.layer_is_shared(layer) else indexer or config.layer_indexer(layer)
    if config.v4 is not None:
        attn = attention_kind(config, layer).name
        kind = f"{attn}/{kind}" if attn == "csa" else attn
    return kind + MOE if config.layer_is_moe(layer) else kind


def _attention_and_selection(config, key):
    """(attention kind or None for the config's one, selection kind or None) of a layer key."""
    kind = key.removesuffix(MOE)
    if config.v4 is None:
        return None, (None if kind == SHARED else kind)
    attn, _, selection = kind.partition("/")
    return attn, selection or None


def prefill_counts(config, L, *, skip, indexer=None, attention=None, selections=None,
                   chunks=None):
    """Counts of a prefill of L tokens. indexer: a selection kind for every full layer
    (None: the config's per-layer choice, flat_index_layers included; shared layers of
    indexer_types select nothing either way). attention: an AttentionShape (default: the
    config's own, attention_shape). selections: {kind: Selection} overrides. chunks:
    [model.buckets.Chunk] (default: chunk_plan's chunks of config.prefill_chunk from 0)."""
    b = itemsize(config)
    layers = tuple(layer_key(config, i, indexer) for i in range(config.n_layers))
    if config.v4 is None:
        kinds = {key.removesuffix(MOE) for key in layers}
        mlps = {key.endswith(MOE) for key in layers}
        keys = set(layers) | {kind + (MOE if moe else "") for kind in kinds - {SHARED}
                              for moe in mlps}
    else:  # the layers as they are (a selection kind lives in its CSA layers' keys)
        keys = set(layers)
    attn = {key: attention or attention_shape(config, layers.index(key) if key in layers
                                              else 0) for key in keys}
    ratio = {"csa": config.v4.csa_ratio} if config.v4 is not None else {}
    sels = {}
    for key in keys:
        kind_attn, selection = _attention_and_selection(config, key)
        if selection is not None:
            sels[key] = (selections or {}).get(selection) or model_selection(
                config, selection, ratio.get(kind_attn, 1))
    if chunks is None:
        chunks = chunk_plan(L, start=0, capacity=length_bucket(L), chunk=config.prefill_chunk)
    per_layer = {key: OpList() for key in keys}
    head = OpList()
    for ch in chunks:
        T = ch.padded
        for key, ops in per_layer.items():
            a, moe = attn[key], key.endswith(MOE)
            ops.extend(other_layer_ops(config, a, T, b,
                                       indexer=config.v4 is None and key in sels, moe=moe)
                       + attention_ops(a, T, ch.position, ch.kv_len, config.top_k, b, skip))
            if key in sels:
                keys_ = ch.kv_len // sels[key].key_ratio
                ops.extend(selection_ops(sels[key], T, ch.position, keys_, skip))
        head.extend(head_ops(config, T, b))
    return PrefillCounts(per_layer, head, layers)


def _layer_params(config, a, layer, *, active):
    """Parameters of layer `layer`: norms, attention, indexer, feed-forward (active: the
    routed experts one token runs, num_experts_per_tok of them, instead of all)."""
    c = config
    a = a or attention_shape(c, layer)
    n = 2 * c.d_model + a.params + a.norm_params + a.own_index_params
    if c.v4 is not None:
        n += 2 * (hc_params(c) + (2 + c.v4.hc_mult) * c.v4.hc_mult + 3)
    elif not c.layer_is_shared(layer):
        n += indexer_params(c) + 2 * c.index_dim  # + the key LayerNorm's scale and bias
    if not c.layer_is_moe(layer):
        return n + 3 * c.d_model * c.d_ff
    m = c.moe
    routed = m.num_experts_per_tok if active else m.n_routed_experts
    if c.layer_is_hashed(layer):  # the token -> experts table replaces the choice bias
        n += c.vocab_size * m.num_experts_per_tok - m.n_routed_experts
    return n + (m.n_routed_experts * (c.d_model + 1)  # router and its bias
                + 3 * c.d_model * m.moe_intermediate_size * (routed + m.n_shared_experts))


def parameter_count(config, attention=None, *, active=False, embeddings=True):
    """nnx.Param count of the model (the coarse screens are not parameters): every expert,
    or active=True the parameters one token runs through (routed experts: the
    num_experts_per_tok chosen). embeddings=False leaves out the input embedding table (a
    lookup, no FLOPs); lm_head stays. attention: projections in place of the config's own."""
    c = config
    # lm_head, plus the embedding table unless it is lm_head too (tied) or left out
    head = c.vocab_size * c.d_model * (2 if embeddings and not c.tie_embeddings else 1)
    if c.v4 is not None:
        N = c.v4.hc_mult
        head += N * N * c.d_model + N + 1  # the last collapse
    return (sum(_layer_params(c, attention, i, active=active) for i in range(c.n_layers))
            + head + c.d_model)


def index_key_bytes(config, *, fp8=False):
    """Bytes of one cached indexer key: index_dim values in the model's dtype, or FP8 as
    V3.2 stores them (1 byte per value + one float32 scale per 128 values: 132 B for 128)."""
    if fp8:
        return config.index_dim + F32 * -(-config.index_dim // 128)
    return config.index_dim * itemsize(config)


def cache_bytes_per_token(config, attention=None, *, index_fp8=False):
    """Bytes per token of a full layer's caches (model.cache): main-attention KV (MLA: the
    latent), indexer keys (index_fp8: in FP8, index_key_bytes) and block summaries;
    attention: an AttentionShape whose cached rows replace the model's."""
    full = next(i for i in range(config.n_layers) if not config.layer_is_shared(i))
    per = layer_bytes_per_token(config, full)
    if attention is not None:
        per["kv"] = attention.cached * itemsize(config)
    if index_fp8:
        per["index_keys"] = index_key_bytes(config, fp8=True)
    return per


def model_cache_bytes_per_token(config, *, index_fp8=False):
    """cache_bytes_per_token summed over the layers (shared layers hold no index part)."""
    per = bytes_per_token(config)
    if index_fp8:
        full = sum(not config.layer_is_shared(i) for i in range(config.n_layers))
        per["index_keys"] = full * index_key_bytes(config, fp8=True)
    return per


def max_context(memory_bytes, weight_bytes, per_token, n_layers, devices=1):
    """Longest context `devices` devices hold, weight_bytes on each: the KV cache split over
    the devices (sequence parallel), indexer keys and block summaries on every device (each
    query scores all earlier keys). per_token: cache_bytes_per_token (n_layers: how many
    layers hold it) or model_cache_bytes_per_token (n_layers=1). Returns 0 when the weights
    alone do not fit; activations and workspace are not counted."""
    free = memory_bytes - weight_bytes
    if free <= 0:
        return 0
    per = n_layers * (per_token["kv"] / devices + per_token["index_keys"]
                      + per_token["block_summaries"])
    return int(free // per)
