"""The grouped matmul (the MoE's expert product) against jax.lax.ragged_dot, and the
kernel table that dispatches it: fresh random inputs, group sizes with empty groups,
rows past the last group (the expert-parallel case: ids of other devices' experts sort
last), lengths that are not tile multiples, poisoned outputs, FP8 block-scaled weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels.api import Implementation, Op
from pallas_kernels.grouped_matmul import (
    GroupedMatmulConfig,
    grouped_matmul_pallas,
    grouped_matmul_reference,
    rows_per_tile,
    tile_schedule,
    tile_work,
)
from tests.pallas_kernels.test_kernels_common import POISON, abstract_gpu_mesh, normal

TINY = GroupedMatmulConfig(block_m=16, block_n=16, block_k=16)


def _random_sizes(rng, M, G, *, foreign):
    """Group sizes summing to M - foreign, with empty groups among them."""
    cuts = np.sort(rng.integers(0, M - foreign + 1, size=G - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [M - foreign]]))
    sizes[rng.choice(G, size=max(1, G // 3), replace=False)] = 0  # empty groups
    sizes[-1] += M - foreign - sizes.sum()
    return jnp.asarray(sizes, jnp.int32)


def _ragged_dot(lhs, rhs, sizes):
    return jax.lax.ragged_dot(lhs, rhs, sizes, precision=jax.lax.Precision.HIGHEST)


def _assert_close(out, ref, rtol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert not np.isnan(out).any(), f"{np.isnan(out).sum()} unwritten (poisoned) entries"
    scale = np.abs(ref).max()
    assert scale > 0
    np.testing.assert_allclose(out, ref, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("seed,M,K,N,G,foreign", [
    (0, 100, 72, 40, 5, 0),     # nothing is a tile multiple
    (1, 77, 33, 20, 8, 13),     # rows past the groups (experts held elsewhere)
    pytest.param(2, 64, 16, 16, 3, 0, marks=pytest.mark.slow),  # exact tiles (budget)
])
def test_kernel_equals_ragged_dot(seed, M, K, N, G, foreign):
    rng = np.random.default_rng(seed)
    sizes = _random_sizes(rng, M, G, foreign=foreign)
    ka, kb = jax.random.split(jax.random.key(seed))
    lhs, rhs = normal(ka, (M, K)), normal(kb, (G, K, N))
    want = _ragged_dot(lhs, rhs, sizes)
    got = grouped_matmul_pallas(lhs, rhs, sizes, config=TINY, interpret=True, poison=POISON)
    _assert_close(got, want, 1e-5)
    assert not np.asarray(got)[M - foreign:].any(), "rows past the groups must be zero"
    # The public op on this CPU: its xla implementation, and the interpreted kernel.
    for impl in ("xla", "xla_tiles", "interpret"):
        _assert_close(pallas_kernels.grouped_matmul(lhs, rhs, sizes, implementation=impl),
                      want, 1e-5)


def test_fp8_blocks_read_as_stored_equal_the_dequantized_reference():
    M, K, N, G, block = 90, 80, 48, 6, (32, 16)  # scale blocks that do not divide K
    rng = np.random.default_rng(3)
    sizes = _random_sizes(rng, M, G, foreign=7)
    ka, kb, ks = jax.random.split(jax.random.key(3), 3)
    lhs = normal(ka, (M, K))
    q = normal(kb, (G, K, N)).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(ks, (G, 3, 3), minval=0.25, maxval=4.0)
    want = _ragged_dot(lhs, pallas_kernels.dequantize_blocks(q, scale, block, jnp.float32),
                       sizes)
    ref = grouped_matmul_reference(lhs, q, sizes, rhs_scale=scale, scale_block=block)
    _assert_close(ref, want, 1e-5)
    got = grouped_matmul_pallas(lhs, q, sizes, rhs_scale=scale, scale_block=block,
                                interpret=True, poison=POISON)
    # float32 rows: each decoded, scaled tile is multiplied in float32 (bf16 rows: in bf16).
    _assert_close(got, want, 1e-5)
    tiles = pallas_kernels.grouped_matmul(lhs, q, sizes, rhs_scale=scale, scale_block=block,
                                          implementation="xla_tiles")
    _assert_close(tiles, want, 1e-5)
    with pytest.raises(ValueError, match="rhs_scale must be"):
        grouped_matmul_reference(lhs, q, sizes, rhs_scale=scale[:, :2], scale_block=block)


@pytest.mark.parametrize("fp8", [False, True])
def test_a_stack_of_layers_experts_is_read_in_place_at_a_traced_layer(fp8):
    """model.layer_stack keeps a model's MoE layers' experts as one stack [S, G, K, N]: the
    op multiplies layer stack_index's groups (traced: a scan's index), the kernel and the
    tile loop reading the stack in place. The other layers hold values that would show."""
    M, K, N, G, S, block = 61, 48, 40, 5, 3, (16, 16)
    rng = np.random.default_rng(5)
    sizes = _random_sizes(rng, M, G, foreign=4)
    ka, kb, ks = jax.random.split(jax.random.key(5), 3)
    lhs = normal(ka, (M, K))
    stack = normal(kb, (S, G, K, N))
    scale = None
    if fp8:
        stack = stack.astype(jnp.float8_e4m3fn)
        scale = jax.random.uniform(ks, (S, G, 3, 3), minval=0.25, maxval=4.0)
    kw = dict(scale_block=block) if fp8 else {}
    for layer in range(S):
        rhs = stack[layer]
        if fp8:
            rhs = pallas_kernels.dequantize_blocks(rhs, scale[layer], block, jnp.float32)
        want = _ragged_dot(lhs, rhs, sizes)
        for impl in ("xla", "xla_tiles", "interpret"):
            got = jax.jit(lambda i, impl=impl: pallas_kernels.grouped_matmul(
                lhs, stack, sizes, rhs_scale=scale, stack_index=i, implementation=impl,
                **kw))(jnp.int32(layer))
            _assert_close(got, want, 1e-5)
        poisoned = grouped_matmul_pallas(lhs, stack, sizes, rhs_scale=scale,
                                         stack_index=jnp.int32(layer), config=TINY,
                                         interpret=True, poison=POISON, **kw)
        _assert_close(poisoned, want, 1e-5)
    with pytest.raises(ValueError, match=r"with stack_index, rhs must be a stack"):
        pallas_kernels.grouped_matmul(lhs, stack[0], sizes, stack_index=0, **kw)


def test_tiles_never_straddle_groups_and_bound_the_work():
    sizes = jnp.asarray([5, 0, 40, 16, 1], jnp.int32)
    group, first, end = (np.asarray(a) for a in tile_schedule(sizes, 70, 16))
    active = first < end
    assert active.sum() == 1 + 0 + 3 + 1 + 1
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for g, f, e in zip(group[active], first[active], end[active]):
        assert starts[g] <= f < e == starts[g] + sizes[g]
    # Work: whole tiles per group, at most (G x (block_m - 1)) rows over the chosen ones.
    assert tile_work(sizes, 16) == 6 * 16
    assert tile_work(sizes, 16) <= int(sizes.sum()) + 5 * 15
    assert rows_per_tile(32768, 256) == 32 and rows_per_tile(8, 256) == 16


def test_table_resolves_for_the_platform_being_compiled_for():
    assert pallas_kernels.target_platform() == "cpu"
    assert pallas_kernels.resolve("grouped_matmul") == "xla"
    assert pallas_kernels.resolve("index_scores") == "xla"
    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh("NVIDIA H100 80GB HBM3")):
        assert pallas_kernels.target_platform() == "gpu"
        assert pallas_kernels.resolve("index_scores") == "pallas"
        assert pallas_kernels.resolve("grouped_matmul") in ("tokamax_triton",
                                                            "tokamax_mosaic", "pallas")
    with pytest.raises(ValueError, match="one of"):
        pallas_kernels.grouped_matmul(jnp.ones((4, 2)), jnp.ones((1, 2, 3)),
                                      jnp.asarray([4], jnp.int32), implementation="cublas")
    with pytest.raises(ValueError, match="compiles for"):
        pallas_kernels.resolve("grouped_matmul", "pallas")
    with pallas_kernels.use_implementations(grouped_matmul="xla_tiles"):
        assert pallas_kernels.resolve("grouped_matmul") == "xla_tiles"
    assert pallas_kernels.resolve("grouped_matmul") == "xla"
    for op in pallas_kernels.OPS.values():
        assert "xla" in op.implementations and op.order["default"][-1] == "xla"


def test_an_implementation_that_declines_passes_to_the_next():
    def declines(x):
        raise NotImplementedError("not these arguments")

    op = Op("toy", {"fast": Implementation(declines), "xla": Implementation(lambda x: x + 1)},
            {"default": ("fast", "xla")})
    assert op(1) == 2
    with pytest.raises(NotImplementedError):
        op(1, implementation="fast")


def test_e4m3_bits_decode_every_value():
    from pallas_kernels.grouped_matmul import e4m3_bits_to_f32
    bits = jnp.arange(256, dtype=jnp.uint8)
    want = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32))
    got = np.asarray(e4m3_bits_to_f32(bits))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
