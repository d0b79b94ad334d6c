"""Lightning-indexer scores: I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]), causal.

`index_scores_reference` is plain jnp; `index_scores_pallas` is the fused Triton-backend
Pallas kernel (q.k -> ReLU -> weighted head sum -> causal mask in one pass, fp32
accumulation), tiled over (query tile, key tile). Tiles entirely in the future of every query
of their query tile are skipped: they only store -inf, so causal prefill does about half
the work of a full [T, L] product.

Coarse scoring on block summaries (hierarchical indexer) uses the same kernel with
`key_block_size=B`: key j then stands for tokens [j*B, (j+1)*B) and is visible to query
position p iff its first token is, i.e. j*B <= p (block-causal: the block holding the
query itself is visible). `causal=False` turns every mask off (all keys visible).
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


def index_scores_reference(q, w, k, *, q_offset=0, key_block_size=1, causal=True):
    """q: [T, H_I, d_I], w: [T, H_I], k: [L, d_I] -> f32[T, L].

    Query i sits at absolute position q_offset + i, key j at position j * key_block_size
    (1 = one key per token; B = key j summarises the token block [j*B, (j+1)*B)); entries
    with j * key_block_size > q_offset + i are -inf (none when causal=False). fp32
    accumulation whatever the input dtype.
    """
    logits = jnp.einsum("thd,ld->thl", q, k, preferred_element_type=jnp.float32)
    scores = jnp.einsum("thl,th->tl", jax.nn.relu(logits), w.astype(jnp.float32))
    if not causal:
        return scores
    q_pos = q_offset + jnp.arange(q.shape[0])[:, None]
    k_pos = key_block_size * jnp.arange(k.shape[0])[None, :]
    return jnp.where(k_pos <= q_pos, scores, -jnp.inf)


@dataclasses.dataclass(frozen=True, slots=True)
class IndexScoresConfig:
    """Tile sizes and Triton launch parameters of the index-scores kernel.

    block_q, block_k: query and key tile (powers of two; shrunk for short inputs). Each
      program keeps a [block_k, d_I] key tile and a [block_q, block_k] f32 accumulator
      resident and streams one [block_q, d_I] head slice of q per head, so shared memory is
      about (block_k + num_stages * block_q) * d_I * itemsize, independent of H_I.
    num_warps, num_stages: Triton launch parameters (passed explicitly, which also selects
      the Triton backend over Mosaic GPU).
    """

    block_q: int = 64  # defaults measured on an H200: docs/findings.md, "Kernel defaults"
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_pow2("block_q", self.block_q)
        check_pow2("block_k", self.block_k)


DEFAULT_CONFIG = IndexScoresConfig()


def _index_scores_kernel(off_ref, q_ref, w_ref, k_ref, *rest, num_heads, key_block_size,
                         causal):
    """One (key tile j, query tile i) program.

    off_ref: i32[1] q_offset; q_ref [bq, H, D]; w_ref [H, bq] f32; k_ref [bk, D];
    rest: (optional aliased poison input, unused), o_ref [bq, bk] f32.
    """
    o_ref = rest[-1]
    bq, bk = o_ref.shape
    j = pl.program_id(0)  # key tile: fastest-varying, so concurrent programs share q in L2
    i = pl.program_id(1)  # query tile
    if not causal:
        o_ref[...] = weighted_relu_scores(q_ref, w_ref, [k_ref[...]], num_heads)[0]
        return

    q_first = off_ref[0] + i * bq
    # Position of the tile's first key; the tile is needed iff it is <= the last query's.
    k_first = j * (bk * key_block_size)
    needed = k_first <= q_first + (bq - 1)

    @pl.when(needed)
    def _compute():
        [scores] = weighted_relu_scores(q_ref, w_ref, [k_ref[...]], num_heads)
        q_pos = q_first + jnp.arange(bq, dtype=jnp.int32)
        k_pos = k_first + key_block_size * jnp.arange(bk, dtype=jnp.int32)
        o_ref[...] = jnp.where(k_pos[None, :] <= q_pos[:, None], scores, -jnp.inf)

    @pl.when(jnp.logical_not(needed))
    def _skip():
        # Entirely in the future: no loads, no matmuls, just the mask value.
        o_ref[...] = neg_inf((bq, bk))


@functools.partial(
    jax.jit,
    static_argnames=("key_block_size", "causal", "config", "interpret", "poison"),
)
def index_scores_pallas(q, w, k, q_offset=0, *, key_block_size=1, causal=True,
                        config: IndexScoresConfig = DEFAULT_CONFIG, interpret=False,
                        poison=None):
    """Pallas version of `index_scores_reference` (same arguments and result).

    q: [T, H_I, d_I] (bf16 or f32), w: [T, H_I], k: [L, d_I] -> f32[T, L].
    q_offset: python int or traced int32 scalar (no recompilation per prefill chunk).
    interpret: False (compiled Triton kernel), True (Pallas interpreter, CPU tests), or a
      `pltpu.InterpretParams()` (the TPU interpreter, which raises on out-of-range reads).
    poison: test-only. A float written into the whole output buffer before the kernel
      runs (the buffer is aliased to the output), so any tile the kernel fails to write
      keeps it and a comparison with the reference fails.
    """
    T, H, D = q.shape
    L = k.shape[0]
    if w.shape != (T, H) or k.shape[1] != D:
        raise ValueError(f"shape mismatch: q {q.shape}, w {w.shape}, k {k.shape}")
    if T == 0 or L == 0:
        return jnp.zeros((T, L), jnp.float32)
    dtype = jnp.promote_types(q.dtype, k.dtype)
    bq = tile_size(config.block_q, T)
    bk = tile_size(config.block_k, L)
    Tp, Lp, Dp = round_up(T, bq), round_up(L, bk), dot_dim(D)

    # Zero padding: padded dims add 0 to q.k, padded heads/queries have zero weight and
    # padded rows/columns are sliced off below.
    qp = pad_axis(pad_axis(q.astype(dtype), 0, Tp), 2, Dp)
    kp = pad_axis(pad_axis(k.astype(dtype), 0, Lp), 1, Dp)
    wt = pad_axis(w.astype(jnp.float32), 0, Tp).T  # [H, Tp]: one contiguous row per head
    args = [as_offset_array(q_offset), qp, wt, kp]
    in_specs = [
        pl.BlockSpec((1,), lambda j, i: (0,)),
        pl.BlockSpec((bq, H, Dp), lambda j, i: (i, 0, 0)),
        pl.BlockSpec((H, bq), lambda j, i: (0, i)),
        pl.BlockSpec((bk, Dp), lambda j, i: (j, 0)),
    ]
    out_spec = pl.BlockSpec((bq, bk), lambda j, i: (i, j))
    aliases = {}
    if poison is not None:
        args.append(jnp.full((Tp, Lp), poison, jnp.float32))
        in_specs.append(out_spec)
        aliases = {len(args) - 1: 0}

    kernel = functools.partial(_index_scores_kernel, num_heads=H,
                               key_block_size=key_block_size, causal=causal)
    out = pl.pallas_call(
        kernel,
        grid=(Lp // bk, Tp // bq),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((Tp, Lp), jnp.float32),
        input_output_aliases=aliases,
        compiler_params=compiler_params(config.num_warps, config.num_stages, interpret),
        interpret=interpret,
        name="index_scores",
    )(*args)
    if (Tp, Lp) != (T, L):
        out = out[:T, :L]
    return out

