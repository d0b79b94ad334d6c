"""Grouped matmul over contiguous row groups (the MoE's expert product), FP8 experts read as
stored.

`grouped_matmul_reference` is `jax.lax.ragged_dot` (after dequantizing FP8 block-scaled
weights); `grouped_matmul_pallas` is dosa's Triton-backend Pallas kernel. Rows are split
into tiles of `block_m` rows that never straddle two groups (a group of n rows takes
ceil(n / block_m) tiles), so each program multiplies its rows by one group's matrix:
the work done is the chosen rows rounded up to whole tiles per group, never the dense
[rows x groups] product XLA's GPU lowering of ragged_dot computes (112 GiB of temporaries
at DeepSeek-V3.2's MoE sizes: docs/gpus.md). FP8 e4m3 weights are dequantized one
[block_k, block_n] tile at a time inside the K loop (decoded from their bits, so A100 runs
it too), with the one block scale covering the tile: no dequantized copy of the expert
stack exists.

The schedule (tile -> group, first row, group end) is computed in jnp from group_sizes; the
grid has the static upper bound of ceil(M / block_m) + G tiles, and tiles past the last
group exit at once. Rows past sum(group_sizes) are zero, as with ragged_dot.

A stack of layers' experts (rhs [S, G, K, N] and `stack_index`: model.layer_stack stores a
model's MoE layers so) is read in place by the kernel and the tile loop (the schedule's
groups offset by stack_index x G into the flattened stack); the reference slices the
layer out first (XLA then copies the layer's whole expert stack: 11.3 GB of
DeepSeek-V3.2's FP8 experts per layer on one device).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    check_pow2,
    compiler_params,
    dot_dim,
    dot_nn,
    pad_axis,
    round_up,
)


def dequantize_blocks(q, scale, block, dtype):
    """Block-scaled weights -> dtype. q: [G, K, N] (e4m3 or any dtype), scale:
    f32[G, ceil(K / block[0]), ceil(N / block[1])], one scale per (block[0] x block[1])
    tile of each group's [K, N] matrix."""
    K, N = q.shape[1:]
    full = jnp.repeat(jnp.repeat(scale, block[0], axis=1), block[1], axis=2)[:, :K, :N]
    return (q.astype(jnp.float32) * full).astype(dtype)


def stack_layer(rhs, rhs_scale, stack_index):
    """(rhs, rhs_scale) of layer stack_index of a stack ([S, G, ...]; None: as given)."""
    if stack_index is None:
        return rhs, rhs_scale
    pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(  # noqa: E731
        a, stack_index, keepdims=False)
    return pick(rhs), pick(rhs_scale)


def check_grouped_args(lhs, rhs, group_sizes, rhs_scale, scale_block, stack_index=None):
    """ValueError naming the argument when the shapes do not fit together (a stack
    [S, G, K, N] with a stack_index is checked as its [G, K, N] layer)."""
    if stack_index is not None:
        if rhs.ndim != 4:
            raise ValueError(f"grouped_matmul: with stack_index, rhs must be a stack "
                             f"[S, G, K, N], got {rhs.shape}")
        rhs = jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype)
        if rhs_scale is not None:
            rhs_scale = jax.ShapeDtypeStruct(rhs_scale.shape[1:], rhs_scale.dtype)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: lhs must be [M, K] and rhs [G, K, N], got lhs "
                         f"{lhs.shape} and rhs {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes must be [G] = [{rhs.shape[0]}], got "
                         f"{group_sizes.shape}")
    if (rhs_scale is None) != (scale_block is None):
        raise ValueError("grouped_matmul: rhs_scale and scale_block go together")
    if rhs_scale is not None:
        G, K, N = rhs.shape
        want = (G, -(-K // scale_block[0]), -(-N // scale_block[1]))
        if tuple(rhs_scale.shape) != want:
            raise ValueError(f"grouped_matmul: rhs_scale must be {want} for rhs {rhs.shape} "
                             f"and scale_block {tuple(scale_block)}, got {rhs_scale.shape}")


def grouped_matmul_reference(lhs, rhs, group_sizes, *, rhs_scale=None, scale_block=None,
                             out_dtype=None, stack_index=None):
    """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes i32[G] (sum <= M)
    -> [M, N]: rows of group g times rhs[g]; rows past the groups are zero. rhs_scale /
    scale_block: rhs is block-scaled (FP8 e4m3 as released), dequantized first.
    stack_index: rhs (and rhs_scale) are a stack [S, G, ...], its layer stack_index used."""
    check_grouped_args(lhs, rhs, group_sizes, rhs_scale, scale_block, stack_index)
    rhs, rhs_scale = stack_layer(rhs, rhs_scale, stack_index)
    out_dtype = out_dtype or lhs.dtype
    if rhs_scale is not None:
        rhs = dequantize_blocks(rhs, rhs_scale, scale_block, lhs.dtype)
    return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32),
                              preferred_element_type=out_dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupedMatmulConfig:
    """Tile sizes and Triton launch parameters of the grouped-matmul kernel.

    block_m: rows per tile (power of two, >= 16). A group of n rows costs ceil(n / block_m)
      tiles, so the work over the chosen rows is at most 1 + G (block_m - 1) / M; None picks
      the largest power of two <= a quarter of the mean group (M / G / 4), in [16, 128]:
      32 at DeepSeek-V3.2's prefill chunk (32768 rows over 256 experts).
    block_n, block_k: output columns and contraction slice per step (powers of two,
      >= 16); with FP8 block scales they are capped to divide the scale block, so one
      scale covers each [block_k, block_n] weight tile.
    num_warps, num_stages: Triton launch parameters (defaults, not autotuned: no GPU has
      timed this kernel yet).
    """

    block_m: int | None = None
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if self.block_m is not None:
            check_pow2("block_m", self.block_m)
        check_pow2("block_n", self.block_n)
        check_pow2("block_k", self.block_k)


DEFAULT_CONFIG = GroupedMatmulConfig()


def rows_per_tile(m, groups, requested=None):
    """block_m for M rows over G groups (GroupedMatmulConfig.block_m)."""
    if requested is not None:
        return requested
    mean = max(1, m // max(groups, 1))
    return max(16, min(128, 1 << max(0, (mean // 4).bit_length() - 1)))


def tile_schedule(group_sizes, m, block_m):
    """(group, first row, group end) i32 each [ceil(m / block_m) + G] of the row tiles;
    tiles past the last group have first row == end == 0 (nothing to do)."""
    G = group_sizes.shape[0]
    n_tiles = -(-m // block_m) + G
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    tiles = -(-sizes // block_m)
    tile_end = jnp.cumsum(tiles)
    row_end = jnp.cumsum(sizes)
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    active = group < G
    g = jnp.minimum(group, G - 1)
    first = row_end[g] - sizes[g] + (t - (tile_end[g] - tiles[g])) * block_m
    end = row_end[g]
    return g, jnp.where(active, first, 0), jnp.where(active, end, 0)


def tile_work(group_sizes, block_m):
    """Rows the kernel multiplies (whole tiles per group) for these group sizes: its work
    is this times K x N x 2 FLOPs, against sum(group_sizes) x K x N x 2 for the rows."""
    sizes = jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)
    return int(jnp.sum(-(-sizes // block_m)) * block_m)


def grouped_matmul_tiles(lhs, rhs, group_sizes, *, rhs_scale=None, scale_block=None,
                         out_dtype=None, stack_index=None, block_m=16):
    """`grouped_matmul_reference` in plain XLA without densifying: a loop over the same row
    tiles as the kernel (tile_schedule), each a [block_m, K] x [K, N] product of one
    group's matrix, dequantized for that tile's group only. The loop runs its static bound
    of ceil(M / block_m) + G tiles, so its work is at most (M + G x block_m) rows: a GPU's
    last resort before ragged_dot's dense product, and what the compile check counts. A
    stack (stack_index) is read in place, one group's matrix per tile."""
    check_grouped_args(lhs, rhs, group_sizes, rhs_scale, scale_block, stack_index)
    M, K = lhs.shape
    N = rhs.shape[-1]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    group, first, end = tile_schedule(group_sizes, M, block_m)
    lhs_p = pad_axis(lhs, 0, M + block_m)
    at = (lambda a, g: a[g]) if stack_index is None else (  # noqa: E731
        lambda a, g: a[stack_index, g])

    def tile(t, out):
        g, f = group[t], first[t]
        w = at(rhs, g)
        if rhs_scale is not None:
            w = dequantize_blocks(w[None], at(rhs_scale, g)[None], scale_block, lhs.dtype)[0]
        y = jnp.dot(jax.lax.dynamic_slice_in_dim(lhs_p, f, block_m), w.astype(lhs.dtype),
                    preferred_element_type=jnp.float32)
        keep = (f + jnp.arange(block_m) < end[t])[:, None]
        current = jax.lax.dynamic_slice_in_dim(out, f, block_m)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(keep, y.astype(out_dtype), current), f, 0)

    out = jax.lax.fori_loop(0, group.shape[0], tile, jnp.zeros((M + block_m, N), out_dtype))
    return out[:M]


def e4m3_bits_to_f32(bits):
    """float8_e4m3fn values from their bits (uint8) by integer arithmetic: Triton casts
    from e4m3 only on Hopper and later, and this runs on A100 too. Normal numbers move
    their exponent from bias 7 to bias 127; subnormals are mantissa x 2^-9; 0x7f / 0xff
    are NaN."""
    b = bits.astype(jnp.int32)
    sign, exp, mant = b >> 7, (b >> 3) & 15, b & 7
    normal = jax.lax.bitcast_convert_type(
        (sign << 31) | ((exp + 120) << 23) | (mant << 20), jnp.float32)
    magnitude = jnp.where(exp == 0, mant.astype(jnp.float32) * 2.0 ** -9,
                          jnp.abs(normal))
    value = jnp.where(sign == 1, -magnitude, magnitude)
    return jnp.where((exp == 15) & (mant == 7), jnp.nan, value)


def _kernel(group_ref, first_ref, end_ref, lhs_ref, rhs_ref, *rest, tiles, n_k, scale_block,
            compute_dtype):
    """One (row tile, column tile) program: out[first:end, cols] = lhs rows @ rhs[group].
    rest: the block scales when scale_block is set, (an aliased poison input,) the output."""
    scale_ref = rest[0] if scale_block else None
    o_ref = rest[-1]
    bm, bn, bk = tiles
    g, first, end = group_ref[0], first_ref[0], end_ref[0]
    n0 = pl.program_id(1) * bn

    @pl.when(first < end)
    def _compute():

        def step(kb, acc):
            k0 = pl.multiple_of(kb * bk, bk)
            a = lhs_ref[pl.ds(first, bm), pl.ds(k0, bk)]
            b = rhs_ref[g, pl.ds(k0, bk), pl.ds(n0, bn)]
            if scale_block:
                s = scale_ref[g, k0 // scale_block[0], n0 // scale_block[1]]
                b = (e4m3_bits_to_f32(b) if b.dtype == jnp.uint8 else b.astype(jnp.float32)) * s
            return acc + dot_nn(a.astype(compute_dtype), b.astype(compute_dtype))

        acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((bm, bn), jnp.float32))
        rows = first + jnp.arange(bm, dtype=jnp.int32)
        plgpu.store(o_ref.at[pl.ds(first, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype),
                    mask=(rows < end)[:, None])


@functools.partial(jax.jit, static_argnames=("scale_block", "out_dtype", "config",
                                             "interpret", "poison"))
def grouped_matmul_pallas(lhs, rhs, group_sizes, *, rhs_scale=None, scale_block=None,
                          out_dtype=None, stack_index=None,
                          config: GroupedMatmulConfig = DEFAULT_CONFIG, interpret=False,
                          poison=None):
    """Pallas version of `grouped_matmul_reference` (same arguments and result). A stack
    (stack_index) is read in place: flattened to [S G, K, N] (no copy), each tile's group
    offset by stack_index x G.

    interpret: run under the Pallas interpreter (CPU tests). poison: a value written into
    the output buffer before the kernel runs (tests: every row of a group must be written).
    """
    check_grouped_args(lhs, rhs, group_sizes, rhs_scale, scale_block, stack_index)
    offset = 0
    if stack_index is not None:
        G = rhs.shape[1]
        offset = jnp.asarray(stack_index, jnp.int32) * G
        rhs = rhs.reshape(-1, *rhs.shape[2:])
        if rhs_scale is not None:
            rhs_scale = rhs_scale.reshape(-1, *rhs_scale.shape[2:])
    M, K = lhs.shape
    G, N = group_sizes.shape[0], rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if M == 0 or N == 0:
        return jnp.zeros((M, N), out_dtype)
    bm = rows_per_tile(M, G, config.block_m)
    bn, bk = min(config.block_n, dot_dim(N)), min(config.block_k, dot_dim(K))
    if scale_block:
        # One scale per weight tile: the tile divides the scale block (a power of two
        # does when the block is a multiple of it; 128 x 128 as released).
        bk, bn = _divisor_tile(bk, scale_block[0]), _divisor_tile(bn, scale_block[1])
    compute_dtype = jnp.promote_types(lhs.dtype, jnp.bfloat16 if scale_block else rhs.dtype)
    Kp, Np = round_up(K, bk), round_up(N, bn)
    # Whole tiles everywhere, so every dynamic slice stays inside its array (real DSA
    # shapes are multiples of 128: nothing is copied there).
    lhs_p = pad_axis(pad_axis(lhs, 0, M + bm), 1, Kp)
    if rhs.dtype == jnp.float8_e4m3fn:  # read as bits, decoded in the kernel
        rhs = jax.lax.bitcast_convert_type(rhs, jnp.uint8)
    rhs_p = pad_axis(pad_axis(rhs, 1, Kp), 2, Np)
    group, first, end = tile_schedule(group_sizes, M, bm)
    group = group + offset  # into the flattened stack
    n_tiles = group.shape[0]

    args = [group, first, end, lhs_p, rhs_p]
    in_specs = [pl.BlockSpec((1,), lambda t, j: (t,))] * 3 + [
        pl.BlockSpec(lhs_p.shape, lambda t, j: (0, 0)),
        pl.BlockSpec(rhs_p.shape, lambda t, j: (0, 0, 0)),
    ]
    if scale_block:
        args.append(rhs_scale.astype(jnp.float32))
        in_specs.append(pl.BlockSpec(rhs_scale.shape, lambda t, j: (0, 0, 0)))
    out_spec = pl.BlockSpec((M + bm, Np), lambda t, j: (0, 0))
    aliases = {}
    if poison is not None:
        args.append(jnp.full((M + bm, Np), poison, out_dtype))
        in_specs.append(out_spec)
        aliases = {len(args) - 1: 0}

    kernel = functools.partial(_kernel, tiles=(bm, bn, bk), n_k=Kp // bk, scale_block=scale_block,
                               compute_dtype=compute_dtype)
    out = pl.pallas_call(
        kernel,
        grid=(n_tiles, Np // bn),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((M + bm, Np), out_dtype),
        input_output_aliases=aliases,
        compiler_params=compiler_params(config.num_warps, config.num_stages, interpret),
        interpret=interpret,
        name="grouped_matmul",
    )(*args)
    total = jnp.sum(jnp.maximum(group_sizes, 0))
    return jnp.where(jnp.arange(M)[:, None] < total, out[:M, :N], 0).astype(out_dtype)


def _divisor_tile(tile, block):
    """The largest power of two <= tile that divides block (>= 16 for tl.dot)."""
    while tile > 16 and block % tile:
        tile //= 2
    if block % tile:
        raise ValueError(f"scale block {block} needs a multiple of 16 for the Pallas "
                         f"grouped matmul (one scale per weight tile)")
    return tile
