"""What each selection kind computes, counted: FLOPs, bytes and top-k / sort work of one call
(T queries at positions p0.., keys [0, kv_len)), as lists of `Op`. Pure arithmetic, no JAX:
the selection table (indexer.selection) names one of these per kind; model.costs adds the
rest of a prefill and experiments.costmodel turns the counts into seconds.

`skip` says whether the kernels skip masked work (the Pallas kernels on GPU: index scores skip
key tiles in the future of a whole query tile, the fine stage skips invalid and future table
columns) or compute every masked entry (the jnp references that run on CPU). Top-k and sort
ops carry no bytes: their measured rates include their memory traffic.
"""

import dataclasses
import math

from indexer.config import STREAMING_KEY_TILE, hierarchical_plan

F32 = 4  # scores, softmax statistics, summaries and index tensors are 4-byte values


@dataclasses.dataclass
class Op:
    """One operation summed over chunks. kind names its rate class (costmodel.rates): a FLOP
    kind ("matmul", "index_scores", "gathered_scores", "sparse_attention",
    "dense_attention"), "topk" (rows, elements = rows x row length, k), "sort" (elements,
    sort_work = elements x log2(row length)), "select" (elements: a threshold select's fixed
    passes over the row), "memory" (bytes only) or "comm" (bytes over the interconnect)."""

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
class Selection:
    """A top-k selection to count. kind: a selection kind; config: its settings (a
    HierarchicalConfig for "hierarchical"; None for a kind without settings).
    tile_candidates: the pipeline of record of the committed H200
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
    key_ratio: int = 1  # positions each key summarises (DeepSeek-V4's CSA entries)


def entry_pairs(p0, T, cap, ratio):
    """sum over positions p0 .. p0+T-1 of min(cap, (p + 1) // ratio): the keys that each
    summarise `ratio` positions and are whole (ratio 1: min(cap, p + 1))."""
    return visible_blocks(p0 - ratio + 1, T, cap, ratio)


def key_pairs(s, p0, T, cap):
    """sum over queries at p0 .. p0+T-1 of the keys each sees, at most cap (entry_pairs
    with the selection's key_ratio)."""
    return entry_pairs(p0, T, cap, s.key_ratio)


def block_pairs(s, p0, T, cap, B):
    """sum over the queries of the key blocks of B keys each sees, at most cap."""
    return visible_blocks(p0 - s.key_ratio + 1, T, cap, s.key_ratio * B)


def _topk(name, rows, cols, k):
    return Op("indexer", name, "topk", rows=rows, elements=rows * max(cols, k), k=k)


def _sort(name, rows, cols):
    return Op("indexer", name, "sort", elements=rows * cols,
              sort_work=rows * cols * math.log2(max(cols, 2)))


def memory_op(stage, name, nbytes):
    return Op(stage, name, "memory", bytes=nbytes)


def flat_ops(s, T, p0, kv_len, skip):
    """Flat selection: index scores of every (query, key) pair, then top-k over each row."""
    pairs = key_pairs(s, p0, T, kv_len) if skip else T * kv_len
    keys = kv_len * s.dim * s.itemsize * -(-T // 64)  # re-read per 64-query tile
    return [Op("indexer", "flat scores", "index_scores", flops=2 * s.heads * s.dim * pairs,
               bytes=T * s.heads * (s.dim * s.itemsize + F32) + keys + T * kv_len * F32),
            _topk("flat top_k", T, kv_len, s.top_k)]


def streaming_ops(s, T, p0, kv_len, skip):
    """Streaming flat selection (indexer.streaming): flat's scores, tile by tile (tiles
    past a query chunk's last position skipped, the score matrix never written), and the
    worst case of its ranking: every visible tile's top-k merged into the running one
    (on CPU at 8K-32K with top_k 1024 nearly every tile merges at full size)."""
    tile = min(STREAMING_KEY_TILE, kv_len)
    # visible tiles of the last query chunk
    tiles = -(-min((p0 + T) // s.key_ratio, kv_len) // tile)
    pairs = key_pairs(s, p0, T, kv_len) if skip else T * tiles * tile
    keys = tiles * tile * s.dim * s.itemsize * -(-T // 64)
    take = min(s.top_k, tile)
    return [Op("indexer", "streaming scores", "index_scores",
               flops=2 * s.heads * s.dim * pairs,
               bytes=T * s.heads * (s.dim * s.itemsize + F32) + keys),
            _topk("streaming tile top_k", T * tiles, tile, take),
            _topk("streaming merge", T * tiles, s.top_k + take, s.top_k)]


def hierarchical_sizes(c, T, kv_len, top_k, heads):
    """(tile, n_blocks, n_cand, n_union, own): the static sizes of one hierarchical_topk
    call (indexer.config.hierarchical_plan)."""
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
    pairs = block_pairs(s, p0, T, nb, B) if skip else T * nb
    ops = [memory_op("indexer", "block means", nb * d * F32 * 2),
           Op("indexer", "coarse scores", "index_scores", flops=2 * hc * d * pairs,
              bytes=T * hc * (d * b + F32) + nb * d * b + T * nb * F32),
           memory_op("indexer", "visibility masks", T * nb * F32 * 2)]
    if hc < H:
        ops += [_topk("coarse heads", T, H, hc),
                memory_op("indexer", "coarse heads", T * hc * d * b)]
    bound = 0 if s.tile_candidates else min(c.bound_blocks, n_cand)
    if c.exact:  # min/max and centre products per head; refinement rounds are not counted
        ops.append(Op("indexer", "upper bounds", "index_scores", flops=6 * H * d * T * nb))
    elif bound:
        ops += [Op("indexer", "spread priority", "matmul", flops=2 * H * H * d * T,
                   bytes=T * nb * F32 * 3)]
    if s.tile_candidates:
        ops += [memory_op("indexer", "tile max", (T + n_tiles) * nb * F32),
                _topk("candidate blocks", n_tiles, nb, n_cand)]
    else:
        ops += [memory_op("indexer", "candidate blocks", T * nb * F32 * 2),
                _topk("candidate blocks", T, nb, n_cand - bound)]
        if bound:
            ops += [memory_op("indexer", "candidate blocks", T * nb),
                    _topk("bound blocks", T, nb, bound)]
        if not (tile == 1 and n_union >= n_cand):
            ops += [memory_op("indexer", "tile union",
                              n_tiles * nb * F32 * 7 + T * n_cand * F32 * 2),
                    _topk("tile union", n_tiles, nb, min(n_union, nb))]
        ops += [_sort("sort blocks", n_tiles, n_union), _sort("sort blocks", T, n_cand)]
        if own:
            ops.append(memory_op("indexer", "table slots", n_tiles * nb * F32 * 2
                            + T * n_cand * F32 * 2))
    columns = B * block_pairs(s, p0, T, n_union, B) if skip else T * n_union * B
    ops.append(Op("indexer", "fine scores", "gathered_scores", flops=2 * H * d * columns,
                  bytes=T * H * (d * b + F32) + T * n_union * B * F32,
                  gather_bytes=n_tiles * n_union * B * d * b, gather_source=kv_len * d * b))
    width = n_cand * B if own else n_union * B
    if own:
        ops.append(memory_op("indexer", "own candidates", T * width * F32 * 3))
    if c.fast_ranking and not c.exact:  # scoring.threshold_topk
        ops.append(Op("indexer", "rank", "select", elements=T * max(width, s.top_k)))
    else:
        ops.append(_topk("rank", T, width, s.top_k))
    ops.append(memory_op("indexer", "token ids", T * s.top_k * F32 * 3))
    return ops


def window_ops(s, T, p0, kv_len, skip):
    """The sliding window scores nothing: its indices are positions."""
    return []


def oracle_ops(s, T, p0, kv_len, skip):
    """The oracle ranks the layer's dense attention: top-k over each row here; the dense
    attention it reads is the model's (model.costs counts it with attention="dense")."""
    return [_topk("oracle top_k", T, kv_len, s.top_k)]
