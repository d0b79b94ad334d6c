"""Shared helpers for the Pallas kernel tests (tests/test_kernels_*.py), and tests of the
kernels' own small helpers (tile-size rules)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common

POISON = float("nan")  # written into the output buffer before the kernel runs


def normal(key, shape, dtype=jnp.float32):
    """Fresh random inputs (never zeros: zeros hide unwritten tiles and bad indexing)."""
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def indexer_inputs(seed, T, L, H, D, dtype=jnp.float32):
    kq, kw, kk = jax.random.split(jax.random.key(seed), 3)
    return normal(kq, (T, H, D), dtype), normal(kw, (T, H)), normal(kk, (L, D), dtype)


def assert_scores_match(out, ref, *, rtol=1e-5, atol=1e-4):
    """Same shape, same -inf pattern, no NaN (poison) anywhere, close finite values."""
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not np.isnan(out).any(), f"{np.isnan(out).sum()} unwritten/NaN entries"
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), fin, err_msg="mask pattern differs")
    np.testing.assert_array_equal(out[~fin], ref[~fin])
    np.testing.assert_allclose(out[fin], ref[fin], rtol=rtol, atol=atol)
    # Guard against vacuous tests: some entries of both kinds unless the case is trivial.
    return fin.mean()


def abstract_gpu_mesh(device_kind):
    return jax.sharding.AbstractMesh(
        (1,), ("x",),
        abstract_device=jax.sharding.AbstractDevice(
            device_kind=device_kind, platform="gpu", num_cores=None))


def lower_for_cuda(f, *structs, device_kind):
    """StableHLO text of f lowered for CUDA on this CPU-only machine (jax >= 0.12 API)."""
    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh(device_kind)):
        return jax.jit(f).trace(*structs).lower(lowering_platforms=("cuda",)).as_text()


TRITON_MARKER = "__gpu$xla.gpu.triton"
DEVICE_KINDS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")


def test_tile_rules():
    assert [_common.next_pow2(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert _common.dot_dim(3) == 16 and _common.dot_dim(100) == 128
    assert _common.tile_size(64, 5) == 16 and _common.tile_size(64, 1000) == 64
    with pytest.raises(ValueError, match="power of two"):
        _common.check_pow2("block_q", 48)


def test_visible_pairs_closed_form():
    from pallas_kernels.bench import visible_pairs
    for T, L, off in [(5, 5, 0), (7, 40, 33), (10, 8, 3), (4, 100, 0), (3, 3, 10)]:
        brute = sum(min(L, off + i + 1) for i in range(T))
        assert visible_pairs(T, L, off) == brute
