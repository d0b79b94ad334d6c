"""The grouped matmul's correctness section of `python -m pallas_kernels.bench`: every
implementation the platform runs, in bf16 and with FP8 128 x 128 block scales, against
jax.lax.ragged_dot on fresh inputs whose row count is not a tile multiple."""

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels


def grouped_case(key, fp8, M, K, N, G=16):
    """The MoE's grouped matmul on fresh inputs: M rows (not a tile multiple) over G
    groups, three of them empty, 37 rows past the last group (experts held elsewhere);
    with fp8, e4m3 weights and 128 x 128 block scales as released (K, N multiples of
    128)."""
    kl, kr, ks, kg = jax.random.split(key, 4)
    cuts = jnp.sort(jax.random.randint(kg, (G - 1,), 0, M - 37))
    sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, jnp.int32), cuts, jnp.array([M - 37])]))
    sizes = sizes.at[jnp.array([1, 7, 12])].set(0)
    sizes = sizes.at[-1].add(M - 37 - sizes.sum()).astype(jnp.int32)
    lhs = jax.random.normal(kl, (M, K), jnp.float32).astype(jnp.bfloat16)
    rhs = jax.random.normal(kr, (G, K, N), jnp.float32) * K ** -0.5
    if not fp8:
        return lhs, rhs.astype(jnp.bfloat16), sizes, None, None
    block = (128, 128)
    scale = jax.random.uniform(ks, (G, K // 128, N // 128), minval=0.5, maxval=2.0)
    return lhs, rhs.astype(jnp.float8_e4m3fn), sizes, scale, block


def section_grouped_correctness(rep, args, key):
    """Every grouped-matmul implementation this platform runs against jax.lax.ragged_dot on
    float32 copies of the same inputs (FP8 weights dequantized for the reference)."""
    op = pallas_kernels.OPS["grouped_matmul"]
    names = (["interpret"] if args.backend == "interpret" else
             [n for n in op.order.get(pallas_kernels.target_platform(), ()) if n != "xla"])
    for label, fp8 in (("bf16", False), ("fp8 128x128 blocks", True)):
        lhs, rhs, sizes, scale, block = grouped_case(
            key, fp8, *((203, 256, 128) if args.smoke else (2000, 640, 384)))
        dense = rhs.astype(jnp.float32) if scale is None else \
            pallas_kernels.dequantize_blocks(rhs, scale, block, jnp.float32)
        ref = jax.jit(lambda a, b, g: lax.ragged_dot(a, b, g, precision=lax.Precision.HIGHEST))(
            lhs.astype(jnp.float32), dense, sizes)
        for name in names:
            try:
                out = pallas_kernels.grouped_matmul(
                    lhs, rhs, sizes, rhs_scale=scale, scale_block=block,
                    out_dtype=jnp.float32, implementation=name)
                rep.check(f"grouped_matmul {name} {label}", out, ref, 1.6e-2)
            except Exception as e:  # noqa: BLE001 - e.g. tokamax's Mosaic kernel on FP8
                rep.error(f"correctness/grouped_matmul {name} {label}", e)
