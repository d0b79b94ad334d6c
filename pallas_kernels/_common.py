"""Helpers shared by the Pallas kernels (padding, tile-size rules, the indexer head loop).

Triton-backend facts these helpers encode (docs/design.md, section 6):
- every array a kernel loads or stores must have a power-of-two number of elements, and a
  `pl.dot` operand needs every dimension >= 16; the wrappers pad to such shapes and slice;
- a kernel reads scalars from 1-element int32 refs (no scalar prefetch on Triton), which is
  how the dynamic `q_offset` gets in without recompiling per chunk.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

# Smallest tile edge that `pl.dot` (tl.dot) accepts.
MIN_DOT_DIM = 16


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def check_pow2(name: str, value: int) -> None:
    if not is_pow2(value):
        raise ValueError(f"{name}={value} must be a power of two (Triton tile shapes)")


def dot_dim(n: int) -> int:
    """Padded size of a dimension that feeds `pl.dot`: a power of two, at least 16."""
    return max(MIN_DOT_DIM, next_pow2(n))


def tile_size(requested: int, extent: int) -> int:
    """The requested power-of-two tile, shrunk for short inputs (but never below 16)."""
    return min(requested, dot_dim(extent))


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_axis(x, axis: int, size: int, value=0):
    """Pads `x` along `axis` up to `size` with `value` (no-op when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def as_offset_array(q_offset):
    """A python int or traced scalar -> i32[1], read inside kernels as `ref[0]`."""
    return jnp.asarray(q_offset, dtype=jnp.int32).reshape(1)


def dot_t(a, b):
    """a [M, K] @ b[N, K]^T -> f32[M, N] (tensor cores for bf16; TF32 for f32 by default).

    `lax.dot_general` directly: `pl.dot` is gone in jax 0.12 and `plgpu.dot` may not exist
    in every jax >= 0.11 this project supports.
    """
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, K] @ b[K, N] -> f32[M, N]."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def weighted_relu_scores(q_ref, w_ref, keys, num_heads: int):
    """sum_h w[:, h] * ReLU(q[:, h, :] . k^T) for one tile, fp32 accumulation.

    q_ref: ref [bq, H, D] (input dtype), w_ref: ref [H, bq] f32 (head-major so each head's
    weights are one contiguous row), keys: a list of key tiles (values [bk_i, D]; several
    when the tile is assembled from separate key blocks). Returns a list of f32[bq, bk_i].

    Loops over heads instead of loading the whole [bq, H, D] query tile: with V3.2 shapes
    (64 queries x 64 heads x 128 dims, bf16) that tile is 1 MiB, far beyond shared memory;
    one head's [bq, D] slice is 16 KiB, and the key tiles stay resident across heads.
    """
    bq = q_ref.shape[0]

    def body(h, accs):
        qh = q_ref[:, h, :]  # [bq, D]
        wh = w_ref[h, :][:, None]  # [bq, 1] f32
        return tuple(acc + jnp.maximum(dot_t(qh, k), 0.0) * wh for acc, k in zip(accs, keys))

    init = tuple(jnp.zeros((bq, k.shape[0]), jnp.float32) for k in keys)
    return list(lax.fori_loop(0, num_heads, body, init))


def compiler_params(num_warps: int, num_stages: int, interpret):
    """Triton launch parameters, given explicitly so a GPU pallas_call takes the Triton
    backend (A100 and Hopper) rather than Mosaic GPU (Hopper only).

    None under the TPU interpreter (`interpret` = `pltpu.InterpretParams()`), which accepts
    only Mosaic TPU parameters; the plain interpreter (`interpret=True`) ignores them.
    """
    if isinstance(interpret, bool):
        return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return None


def neg_inf(shape):
    return jnp.full(shape, -jnp.inf, dtype=jnp.float32)


