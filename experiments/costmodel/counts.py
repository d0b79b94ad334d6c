"""What a dosa prefill computes, counted: FLOPs, bytes and top-k / sort work of each operation,
per layer and summed, plus the bytes per token of every cache and the context a device holds.

Pure arithmetic over a ModelConfig, no arrays; experiments.costmodel turns the counts into
seconds with the rates of experiments.costmodel.rates. The prefill is counted the way
model.runner.ModelRunner runs it: chunks of `prefill_chunk` queries, chunk c reading keys
cache[:kv_len] with kv_len = length_bucket(end of chunk c). `skip` says whether the kernels
skip masked work (the Pallas kernels on GPU: index scores skip key tiles in the future of a
whole query tile, the fine stage skips invalid and future table columns, sparse attention
stops at a query's last valid index) or compute every masked entry (the jnp references that
run on CPU). Top-k and sort ops carry no bytes: their measured rates include their memory
traffic.
"""

import dataclasses
import math

from indexer.hierarchical import PACKED_MAX_COLUMN_BITS, hierarchical_plan
from model.runner import length_bucket

STAGES = ("other", "indexer", "attention")
F32 = 4  # scores, softmax statistics, summaries and index tensors are 4-byte values


@dataclasses.dataclass
class Op:
    """One operation summed over chunks. kind names its rate class (costmodel.rates): a FLOP
    kind ("matmul", "index_scores", "gathered_scores", "sparse_attention",
    "dense_attention"), "topk" (rows, elements = rows x row length, k), "sort" (elements,
    sort_work = elements x log2(row length)), "memory" (bytes only) or "comm" (bytes over the
    interconnect)."""

    stage: str
    name: str
    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    rows: float = 0.0
    elements: float = 0.0
    sort_work: float = 0.0
    k: int = 0
    gather_bytes: float = 0.0  # random row reads ...
    gather_source: float = 0.0  # ... from an array of this many bytes (the largest chunk's)

    def key(self):
        return self.stage, self.name, self.kind, self.k

    def scaled(self, factor):
        return dataclasses.replace(self, **{f: getattr(self, f) * factor for f in _SUMMED})


_SUMMED = ("flops", "bytes", "rows", "elements", "sort_work", "gather_bytes")


class OpList:
    """Ops merged by (stage, name, kind, k): a chunk loop adds into one entry per op."""

    def __init__(self, ops=()):
        self.ops = {}
        self.extend(ops)

    def add(self, op):
        old = self.ops.setdefault(op.key(), dataclasses.replace(op, **{f: 0.0 for f in _SUMMED}))
        for f in _SUMMED:
            setattr(old, f, getattr(old, f) + getattr(op, f))
        old.gather_source = max(old.gather_source, op.gather_source)

    def extend(self, ops):
        for op in ops:
            self.add(op)
        return self

    def __iter__(self):
        return iter(self.ops.values())

    def scaled(self, factor):
        return OpList(op.scaled(factor) for op in self)

    def totals(self):
        """{stage: {"flops", "bytes"}} over the stages present; bytes include gathered rows
        (whether a cache would serve them or not)."""
        out = {}
        for op in self:
            s = out.setdefault(op.stage, {"flops": 0.0, "bytes": 0.0})
            s["flops"] += op.flops
            s["bytes"] += op.bytes + op.gather_bytes
        return out


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


def itemsize(config):
    return 2 if config.dtype == "bfloat16" else 4


def _tri(n):
    return n * (n + 1) // 2


def visible_keys(p0, T, cap):
    """sum over positions p0 .. p0+T-1 of min(cap, p + 1): causal (query, key) pairs."""
    lo, hi = p0, p0 + T
    mid = min(max(cap - 1, lo), hi)
    return _tri(mid) - _tri(lo) + cap * (hi - mid)


def _floor_sum(n, B):
    """sum_{p < n} p // B."""
    q, r = divmod(n, B)
    return B * q * (q - 1) // 2 + r * q


def visible_blocks(p0, T, cap, B):
    """sum over positions p0 .. p0+T-1 of min(cap, p // B + 1): blocks seen, capped."""
    lo, hi = p0, p0 + T
    mid = min(max((cap - 1) * B, lo), hi)
    return _floor_sum(mid, B) - _floor_sum(lo, B) + (mid - lo) + cap * (hi - mid)


@dataclasses.dataclass(frozen=True)
class Chunk:
    queries: int  # rows computed (padded to the chunk's bucket)
    start: int
    kv_len: int


def prefill_chunks(n, chunk):
    """The chunks ModelRunner.prefill runs for n tokens from position 0."""
    cap = length_bucket(n)
    out = []
    for offset in range(0, n, chunk):
        piece = min(chunk, n - offset)
        size = min(chunk, length_bucket(piece, minimum=16), cap - offset)
        out.append(Chunk(size, offset, min(cap, length_bucket(offset + size))))
    return out


@dataclasses.dataclass(frozen=True)
class Selection:
    """A top-k selection to count. kind "flat" or "hierarchical" (with `config`, a
    HierarchicalConfig). tile_candidates: the pipeline of record of the committed H200
    benchmark (each query tile's table = its n_cand blocks of best coarse score over the
    tile, no per-query lists, every query ranks the whole table) instead of
    indexer.hierarchical_topk's per-query candidate lists and tile union."""

    kind: str
    heads: int
    dim: int
    top_k: int
    itemsize: int
    config: object = None
    tile_candidates: bool = False


def model_selection(config, kind):
    return Selection(kind, config.index_heads, config.index_dim, config.top_k, itemsize(config),
                     config.hierarchical)


def _topk(name, rows, cols, k):
    return Op("indexer", name, "topk", rows=rows, elements=rows * max(cols, k), k=k)


def _sort(name, rows, cols):
    return Op("indexer", name, "sort", elements=rows * cols,
              sort_work=rows * cols * math.log2(max(cols, 2)))


def _mem(stage, name, nbytes):
    return Op(stage, name, "memory", bytes=nbytes)


def flat_ops(s, T, p0, kv_len, skip):
    """Flat selection: index scores of every (query, key) pair, then top-k over each row."""
    pairs = visible_keys(p0, T, kv_len) if skip else T * kv_len
    keys = kv_len * s.dim * s.itemsize * -(-T // 64)  # re-read per 64-query tile
    return [Op("indexer", "flat scores", "index_scores", flops=2 * s.heads * s.dim * pairs,
               bytes=T * s.heads * (s.dim * s.itemsize + F32) + keys + T * kv_len * F32),
            _topk("flat top_k", T, kv_len, s.top_k)]


def hierarchical_sizes(c, T, kv_len, top_k, heads):
    """(tile, n_blocks, n_cand, n_union, own): the static sizes of one hierarchical_topk
    call (indexer.hierarchical.hierarchical_plan)."""
    plan = hierarchical_plan(c, T, kv_len, top_k, heads)
    return plan.tile, plan.n_blocks, plan.n_cand, plan.n_union, plan.own


def hierarchical_ops(s, T, p0, kv_len, skip):
    """Hierarchical selection, step by step as indexer.hierarchical_topk runs it (or the
    H200 benchmark's pipeline, s.tile_candidates)."""
    c, H, d, b = s.config, s.heads, s.dim, s.itemsize
    B = c.block_size
    tile, nb, n_cand, n_union, own = hierarchical_sizes(c, T, kv_len, s.top_k, H)
    if s.tile_candidates:
        n_union, own = n_cand, False
    n_tiles = -(-T // tile)
    hc = min(c.coarse_heads or H, H)
    pairs = visible_blocks(p0, T, nb, B) if skip else T * nb
    ops = [_mem("indexer", "block means", nb * d * F32 * 2),
           Op("indexer", "coarse scores", "index_scores", flops=2 * hc * d * pairs,
              bytes=T * hc * (d * b + F32) + nb * d * b + T * nb * F32),
           _mem("indexer", "visibility masks", T * nb * F32 * 2)]
    if hc < H:
        ops += [_topk("coarse heads", T, H, hc), _mem("indexer", "coarse heads", T * hc * d * b)]
    bound = 0 if s.tile_candidates else min(c.bound_blocks, n_cand)
    if c.exact:  # min/max and centre products per head; refinement rounds are not counted
        ops.append(Op("indexer", "upper bounds", "index_scores", flops=6 * H * d * T * nb))
    elif bound:
        ops += [Op("indexer", "spread priority", "matmul", flops=2 * H * H * d * T,
                   bytes=T * nb * F32 * 3)]
    if s.tile_candidates:
        ops += [_mem("indexer", "tile max", (T + n_tiles) * nb * F32),
                _topk("candidate blocks", n_tiles, nb, n_cand)]
    else:
        ops += [_mem("indexer", "candidate blocks", T * nb * F32 * 2),
                _topk("candidate blocks", T, nb, n_cand - bound)]
        if bound:
            ops += [_mem("indexer", "candidate blocks", T * nb),
                    _topk("bound blocks", T, nb, bound)]
        if not (tile == 1 and n_union >= n_cand):
            ops += [_mem("indexer", "tile union", n_tiles * nb * F32 * 7 + T * n_cand * F32 * 2),
                    _topk("tile union", n_tiles, nb, min(n_union, nb))]
        ops += [_sort("sort blocks", n_tiles, n_union), _sort("sort blocks", T, n_cand)]
        if own:
            ops.append(_mem("indexer", "table slots", n_tiles * nb * F32 * 2
                            + T * n_cand * F32 * 2))
    columns = B * visible_blocks(p0, T, n_union, B) if skip else T * n_union * B
    ops.append(Op("indexer", "fine scores", "gathered_scores", flops=2 * H * d * columns,
                  bytes=T * H * (d * b + F32) + T * n_union * B * F32,
                  gather_bytes=n_tiles * n_union * B * d * b, gather_source=kv_len * d * b))
    width = n_cand * B if own else n_union * B
    if own:
        ops.append(_mem("indexer", "own candidates", T * width * F32 * 3))
    packed = c.fast_ranking and not c.exact and max(width, s.top_k) <= 1 << PACKED_MAX_COLUMN_BITS
    ops.append(_sort("rank", T, max(width, s.top_k)) if packed
               else _topk("rank", T, width, s.top_k))
    ops.append(_mem("indexer", "token ids", T * s.top_k * F32 * 3))
    return ops


def selection_ops(s, T, p0, kv_len, skip):
    """Ops of one selection call: T queries at positions p0.., keys [0, kv_len)."""
    if s.kind == "flat":
        return flat_ops(s, T, p0, kv_len, skip)
    if s.kind == "hierarchical":
        return hierarchical_ops(s, T, p0, kv_len, skip)
    raise ValueError(f"selection kind must be 'flat' or 'hierarchical', got {s.kind!r}")


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


def other_layer_ops(config, a, T, b):
    """Per layer: projections, MLP, norms, RoPE, residuals, cache writes, summary appends.
    The indexer's projections are here: linear in T, like every projection."""
    c = config
    idx_out = c.index_heads * c.index_dim + c.index_dim + c.index_heads
    elementwise = T * b * (2 * 2 * c.d_model  # two RMSNorms, read + write
                           + 2 * a.heads * a.qk_dim + 2 * a.kv_heads * a.kv_row  # RoPE
                           + 2 * (c.index_heads + 2) * c.index_dim  # indexer RoPE, LayerNorm
                           + 3 * c.d_ff + 2 * 3 * c.d_model)  # SwiGLU, two residuals
    return [_linear("attention projections", a.params, c.d_model,
                    a.heads * (a.qk_dim + a.v_dim), T, b),
            _linear("indexer projections", c.d_model * idx_out, c.d_model, idx_out, T, b),
            _linear("mlp", 3 * c.d_model * c.d_ff, c.d_model, 3 * c.d_ff, T, b),
            _mem("other", "elementwise", elementwise),
            _mem("other", "cache writes", T * (a.kv_heads * a.kv_row + c.index_dim) * b
                 + T * c.index_dim * (F32 * 4 + b))]


def head_ops(config, T, b):
    c = config
    return [_mem("other", "embedding and final norm", T * c.d_model * b * 3),
            _linear("lm_head", c.d_model * c.vocab_size, c.d_model, c.vocab_size, T, b)]


@dataclasses.dataclass
class PrefillCounts:
    """per_layer[kind]: one layer with that selection, over the whole prefill; head: the
    embedding, final norm and lm_head; layers: the selection of each layer."""

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
    """Counts of a prefill of L tokens. indexer: "flat" / "hierarchical" for every layer
    (None: the config's per-layer choice, flat_index_layers included). attention: an
    AttentionShape (default: the config's GQA). selections: {kind: Selection} overrides.
    chunks: [Chunk] (default: the runner's chunks of config.prefill_chunk)."""
    a = attention or gqa_attention(config)
    b = itemsize(config)
    layers = tuple(indexer or config.layer_indexer(i) for i in range(config.n_layers))
    sels = {kind: model_selection(config, kind) for kind in set(layers)}
    sels.update(selections or {})
    chunks = chunks or prefill_chunks(L, config.prefill_chunk)
    per_layer = {kind: OpList() for kind in sels}
    head = OpList()
    for ch in chunks:
        common = other_layer_ops(config, a, ch.queries, b) + attention_ops(
            a, ch.queries, ch.start, ch.kv_len, config.top_k, b, skip)
        for kind, s in sels.items():
            per_layer[kind].extend(common).extend(
                selection_ops(s, ch.queries, ch.start, ch.kv_len, skip))
        head.extend(head_ops(config, ch.queries, b))
    return PrefillCounts(per_layer, head, layers)


def parameter_count(config, attention=None):
    """Weights of the model (with `attention`'s projections in place of the GQA ones)."""
    c = config
    a = attention or gqa_attention(config)
    indexer = c.d_model * (c.index_heads * c.index_dim + c.index_dim + c.index_heads) \
        + 2 * c.index_dim
    layer = 2 * c.d_model + a.params + indexer + 3 * c.d_model * c.d_ff
    return c.n_layers * layer + 2 * c.vocab_size * c.d_model + c.d_model


def cache_bytes_per_token(config, attention=None):
    """Bytes per token of each cache, per layer: main-attention KV, indexer keys, and block
    summaries (f32 sum, min, max of d_I values plus count and radius per block of
    block_size tokens)."""
    a = attention or gqa_attention(config)
    return {"kv": a.kv_heads * a.kv_row * itemsize(config),
            "index_keys": config.index_dim * itemsize(config),
            "block_summaries": (3 * config.index_dim + 2) * F32 / config.hierarchical.block_size}


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
