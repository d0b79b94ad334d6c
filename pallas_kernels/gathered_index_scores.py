"""Fine-stage indexer scores over candidate key blocks read through a block table.

`gathered_index_scores_reference` is plain jnp; `gathered_index_scores_pallas` is the
Triton-backend Pallas kernel. It is the index-scores kernel with its key tile gathered
through the block table instead of sliced from the key array: each program owns a tile of
queries and `block_k` consecutive output columns, reads the ids of the candidate blocks
behind those columns from the table (scalar int loads), loads each block's keys as one
contiguous slice starting at block_id * block_size, runs the same head loop (q.k -> ReLU ->
weighted head sum, fp32), and writes -inf for invalid, out-of-range and future tokens.
Programs whose columns are all invalid or all in the future of their queries skip the loads
and matmuls.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    as_offset_array,
    check_pow2,
    compiler_params,
    dot_dim,
    neg_inf,
    pad_axis,
    round_up,
    tile_size,
    weighted_relu_scores,
)


def gathered_index_scores_reference(q, w, k, block_table, *, block_size, q_offset=0):
    """Scores of query tiles against the key blocks their block table names.

    q: [T, H_I, d_I], w: [T, H_I], k: [L, d_I],
    block_table: i32[n_tiles, n_cand], one row per tile of query_tile = T // n_tiles
        consecutive queries (T must be a multiple of n_tiles; one row per query is the
        untiled case), naming candidate key blocks of block_size tokens (-1 = none).
    Returns f32[T, n_cand * block_size]; column c is token block_table[tile(t), c // B] * B
    + c % B. Entries are -inf where the block id is -1, the token is >= L, or the token is
    in the future of the query (token > q_offset + t).
    """
    T = q.shape[0]
    n_tiles, n_cand = block_table.shape
    if T % n_tiles:
        raise ValueError(f"T={T} must be a multiple of block_table rows={n_tiles}")
    query_tile = T // n_tiles
    L = k.shape[0]
    tokens = block_table[:, :, None] * block_size + jnp.arange(block_size)  # [n_tiles, n_cand, B]
    tokens = tokens.reshape(n_tiles, n_cand * block_size)
    valid = (block_table[:, :, None] >= 0).repeat(block_size, axis=2).reshape(tokens.shape)
    valid &= tokens < L
    k_g = k[jnp.clip(tokens, 0, L - 1)]  # [n_tiles, C, d_I]
    qt = q.reshape(n_tiles, query_tile, *q.shape[1:])
    wt = w.reshape(n_tiles, query_tile, w.shape[1]).astype(jnp.float32)
    logits = jnp.einsum("nthd,ncd->nthc", qt, k_g, preferred_element_type=jnp.float32)
    scores = jnp.einsum("nthc,nth->ntc", jax.nn.relu(logits), wt)
    q_pos = q_offset + jnp.arange(T).reshape(n_tiles, query_tile)
    visible = valid[:, None, :] & (tokens[:, None, :] <= q_pos[:, :, None])
    return jnp.where(visible, scores, -jnp.inf).reshape(T, n_cand * block_size)


@dataclasses.dataclass(frozen=True, slots=True)
class GatheredScoresConfig:
    """Tile sizes and Triton launch parameters of the gathered-scores kernel.

    block_q: queries per program (power of two; at most the padded query tile, at least 16
      because tl.dot needs it: a table with one row per query wastes up to 16x compute).
    block_k: output columns per program (power of two): block_k // block_size whole
      candidate blocks when block_size < block_k, else a block_k slice of one block.
    num_warps, num_stages: Triton launch parameters.
    """

    block_q: int = 64
    block_k: int = 128
    num_warps: int = 8  # defaults measured on an H200: docs/findings.md, "Kernel defaults"
    num_stages: int = 3

    def __post_init__(self):
        check_pow2("block_q", self.block_q)
        check_pow2("block_k", self.block_k)


DEFAULT_CONFIG = GatheredScoresConfig()


def _gathered_kernel(off_ref, q_ref, w_ref, k_ref, bt_ref, *rest, num_heads, block_size,
                     sub_size, query_tile, padded_tile, key_len):
    """One (column tile j, query rows i) program.

    off_ref i32[1] q_offset; q_ref [bq, H, D] (rows of the padded, tile-major query layout);
    w_ref [H, bq] f32; k_ref [L_pad, D] (whole key array, L_pad a multiple of block_size);
    bt_ref i32[n_cand_pad] (this program's block-table row); rest: (optional aliased poison
    input, unused), o_ref [bq, bk] f32. The bk columns are bk // sub_size sub-tiles of
    sub_size = min(block_size, bk) tokens, each contiguous inside one candidate block.
    """
    o_ref = rest[-1]
    bq, bk = o_ref.shape
    j = pl.program_id(0)  # column tile: fastest-varying, so programs share q in L2
    i = pl.program_id(1)  # rows i*bq .. i*bq+bq-1 of the padded query layout
    row0 = i * bq
    tile = row0 // padded_tile
    r0 = row0 - tile * padded_tile  # first row's index inside its query tile
    q_first = off_ref[0] + tile * query_tile + r0
    # Last real query of this program (padding rows of a tile have no position).
    q_last = off_ref[0] + tile * query_tile + jnp.minimum(r0 + bq, query_tile) - 1

    starts, valids = [], []
    needed = False
    for s in range(bk // sub_size):
        col = j * bk + s * sub_size
        block_id = bt_ref[col // block_size]  # scalar int load
        start = block_id * block_size + col % block_size  # first token of the sub-tile
        valid = (block_id >= 0) & (start < key_len)
        starts.append(start)
        valids.append(valid)
        needed = needed | (valid & (start <= q_last))

    @pl.when(needed)
    def _compute():
        # Contiguous dynamic-start slices: every address is in range whatever the table
        # holds (invalid ids read block 0 and are masked below; k is padded to whole
        # blocks), which keeps Triton loads coalesced and lets the TPU interpreter (which
        # raises on out-of-range reads and has no gathers) run this kernel in tests.
        keys = [k_ref[pl.ds(jnp.where(v, st, 0), sub_size), :] for st, v in zip(starts, valids)]
        scores = weighted_relu_scores(q_ref, w_ref, keys, num_heads)
        q_pos = q_first + jnp.arange(bq, dtype=jnp.int32)
        for s, (sc, st, v) in enumerate(zip(scores, starts, valids)):
            tokens = st + jnp.arange(sub_size, dtype=jnp.int32)
            visible = v & (tokens[None, :] < key_len) & (tokens[None, :] <= q_pos[:, None])
            o_ref[:, pl.ds(s * sub_size, sub_size)] = jnp.where(visible, sc, -jnp.inf)

    @pl.when(jnp.logical_not(needed))
    def _skip():
        o_ref[...] = neg_inf((bq, bk))


@functools.partial(
    jax.jit, static_argnames=("block_size", "config", "interpret", "poison"))
def gathered_index_scores_pallas(q, w, k, block_table, q_offset=0, *, block_size,
                                 config: GatheredScoresConfig = DEFAULT_CONFIG,
                                 interpret=False, poison=None):
    """Pallas version of `gathered_index_scores_reference` (same arguments and result).

    q: [T, H_I, d_I], w: [T, H_I], k: [L, d_I], block_table: i32[n_tiles, n_cand]
    -> f32[T, n_cand * block_size]. q_offset: python int or traced int32 scalar.
    block_size must be a power of two (Triton tile shapes); use the reference otherwise.
    interpret / poison: as in `index_scores_pallas`.
    """
    T, H, D = q.shape
    L = k.shape[0]
    n_tiles, n_cand = block_table.shape
    check_pow2("block_size", block_size)
    if T % n_tiles:
        raise ValueError(f"T={T} must be a multiple of block_table rows={n_tiles}")
    if w.shape != (T, H) or k.shape[1] != D:
        raise ValueError(f"shape mismatch: q {q.shape}, w {w.shape}, k {k.shape}")
    C = n_cand * block_size
    if T == 0 or C == 0:
        return jnp.zeros((T, C), jnp.float32)
    if L == 0:
        return jnp.full((T, C), -jnp.inf, jnp.float32)
    dtype = jnp.promote_types(q.dtype, k.dtype)
    query_tile = T // n_tiles
    padded_tile = dot_dim(query_tile)
    bq = min(config.block_q, padded_tile)
    bk = tile_size(config.block_k, C)
    sub_size = min(block_size, bk)
    Cp, Dp = round_up(C, bk), dot_dim(D)
    n_cand_pad = Cp // block_size if block_size <= bk else -(-Cp // block_size)
    rows = n_tiles * padded_tile

    # Tile-major padded query layout: tile n occupies rows [n * padded_tile, ...); its
    # padding rows have zero q and w and are sliced off below.
    qp = pad_axis(q.astype(dtype).reshape(n_tiles, query_tile, H, D), 1, padded_tile)
    qp = pad_axis(qp.reshape(rows, H, D), 2, Dp)
    wt = pad_axis(w.astype(jnp.float32).reshape(n_tiles, query_tile, H), 1, padded_tile)
    wt = wt.reshape(rows, H).T  # [H, rows]
    # Whole blocks, so a slice of any valid block stays inside the array.
    kp = pad_axis(pad_axis(k.astype(dtype), 0, round_up(L, block_size)), 1, Dp)
    bt = pad_axis(block_table.astype(jnp.int32), 1, n_cand_pad, value=-1)

    args = [as_offset_array(q_offset), qp, wt, kp, bt]
    in_specs = [
        pl.BlockSpec((1,), lambda j, i: (0,)),
        pl.BlockSpec((bq, H, Dp), lambda j, i: (i, 0, 0)),
        pl.BlockSpec((H, bq), lambda j, i: (0, i)),
        pl.BlockSpec(kp.shape, lambda j, i: (0, 0)),
        pl.BlockSpec((None, n_cand_pad), lambda j, i: ((i * bq) // padded_tile, 0)),
    ]
    out_spec = pl.BlockSpec((bq, bk), lambda j, i: (i, j))
    aliases = {}
    if poison is not None:
        args.append(jnp.full((rows, Cp), poison, jnp.float32))
        in_specs.append(out_spec)
        aliases = {len(args) - 1: 0}

    kernel = functools.partial(
        _gathered_kernel, num_heads=H, block_size=block_size, sub_size=sub_size,
        query_tile=query_tile, padded_tile=padded_tile, key_len=L)
    out = pl.pallas_call(
        kernel,
        grid=(Cp // bk, rows // bq),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((rows, Cp), jnp.float32),
        input_output_aliases=aliases,
        compiler_params=compiler_params(config.num_warps, config.num_stages, interpret),
        interpret=interpret,
        name="gathered_index_scores",
    )(*args)
    if padded_tile != query_tile:
        out = out.reshape(n_tiles, padded_tile, Cp)[:, :query_tile].reshape(T, Cp)
    if Cp != C:
        out = out[:, :C]
    return out
