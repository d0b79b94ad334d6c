"""tokamax's grouped matmul (openxla/tokamax `ragged_dot`) behind dosa's grouped-matmul
contract: FP8 block-scaled weights as a qwix QArray (dequantized tile by tile inside
tokamax's Triton kernel), rows past the groups zero (tokamax leaves them unwritten).

GPU only, from the `cuda12` extra (tokamax, jax-triton, triton); imported on first use, so
`pallas_kernels` imports without them. Each function raises NotImplementedError for inputs
its kernel does not take, which makes the dispatch table try the next implementation.
"""

import importlib.util

import jax.numpy as jnp

from pallas_kernels.grouped_matmul import rows_per_tile

# Which of tokamax's implementations each dosa name runs, and the modules it needs.
KERNELS = {"tokamax_triton": ("triton", ("tokamax", "jax_triton", "triton")),
           "tokamax_mosaic": ("mosaic", ("tokamax",))}


def installed(name):
    """Whether the modules tokamax's `name` kernel needs can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in KERNELS[name][1])


def ragged_dot(name, lhs, rhs, group_sizes, *, rhs_scale=None, scale_block=None,
               out_dtype=None, stack_index=None):
    """grouped_matmul_reference's contract through tokamax's kernel `name` (KERNELS).
    A stack of layers' experts (stack_index) is passed on: tokamax takes one layer's
    [G, K, N], which XLA would copy out of the stack first, and its grid spans every
    group, so a flattened stack would multiply it by the layers."""
    import qwix
    import tokamax

    if stack_index is not None:
        raise NotImplementedError(f"{name}: a stack of layers' experts is read in place by "
                                  "the pallas kernel")

    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if rhs_scale is not None:
        G, K, N = rhs.shape
        if K % scale_block[0] or N % scale_block[1]:
            # tokamax derives the scale tile as K // scale rows: blocks must divide.
            raise NotImplementedError(f"{name}: scale blocks {scale_block} must divide "
                                      f"[K, N] = [{K}, {N}]")
        rhs = qwix.QArray(qvalue=rhs, scale=rhs_scale.astype(jnp.float32), zero_point=None,
                          qtype=rhs.dtype)
    out = tokamax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             preferred_element_type=out_dtype,
                             implementation=[_kernel(name, lhs.shape[0], len(group_sizes))])
    total = jnp.sum(jnp.maximum(group_sizes, 0))
    return jnp.where(jnp.arange(lhs.shape[0])[:, None] < total, out, 0).astype(out_dtype)


def _kernel(name, m, groups):
    """tokamax's op `name` for m rows over `groups` groups. The Triton kernel gets dosa's
    row tile (pallas_kernels.grouped_matmul.rows_per_tile: a quarter of the mean group),
    since tokamax's default of 128 rows wastes up to half its work on groups of ~128 rows
    (DeepSeek-V3.2's prefill chunk); its other tiles are tokamax's defaults. Mosaic GPU
    keeps tokamax's own choice."""
    from tokamax.ops import gpu

    if name == "tokamax_mosaic":
        return KERNELS[name][0]
    return gpu.PallasTritonRaggedDot(config=gpu.PallasTritonRaggedDotConfig(
        block_m=rows_per_tile(m, groups), block_n=128, block_k=32, num_warps=4,
        num_stages=4))
