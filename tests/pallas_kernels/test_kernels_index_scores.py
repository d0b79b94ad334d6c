"""index_scores Pallas kernel (interpret mode) against its jnp reference."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from pallas_kernels.index_scores import (
    IndexScoresConfig,
    index_scores_pallas,
    index_scores_reference,
)
from tests.pallas_kernels.test_kernels_common import POISON, assert_scores_match, indexer_inputs

SMALL = IndexScoresConfig(block_q=16, block_k=32)  # many tiles on small inputs
TINY = IndexScoresConfig(block_q=16, block_k=16)

# (seed, T, L, H, D, q_offset, dtype, key_block_size, config): no length is a tile multiple.
CASES = [
    pytest.param(0, 100, 150, 4, 64, 0, jnp.float32, 1, None, id="prefill-from-0"),
    pytest.param(1, 70, 107, 3, 24, 37, jnp.bfloat16, 1, SMALL, id="last-chunk-causal-edge"),
    pytest.param(2, 33, 300, 4, 64, 50, jnp.float32, 1, SMALL, id="offset-future-tiles"),
    pytest.param(3, 50, 13, 4, 32, 30, jnp.float32, 8, TINY, id="coarse-block-causal"),
    pytest.param(4, 1, 77, 2, 16, 76, jnp.float32, 1, None, id="decode-one-query"),
]


@pytest.mark.parametrize("seed,T,L,H,D,q_offset,dtype,kbs,config", CASES)
def test_matches_reference(seed, T, L, H, D, q_offset, dtype, kbs, config):
    q, w, k = indexer_inputs(seed, T, L, H, D, dtype)
    kw = {} if config is None else {"config": config}
    out = index_scores_pallas(q, w, k, q_offset, key_block_size=kbs, interpret=True,
                              poison=POISON, **kw)
    ref = index_scores_reference(q, w, k, q_offset=q_offset, key_block_size=kbs)
    tol = 1e-5 if dtype == jnp.float32 else 1e-4
    frac = assert_scores_match(out, ref, rtol=tol, atol=tol)
    if T > 1:
        assert 0 < frac < 1  # both visible and masked entries were checked


def test_poison_survives_where_nothing_is_written(monkeypatch):
    """The poison path can fail: a kernel that writes no tile returns pure poison."""
    mod = sys.modules["pallas_kernels.index_scores"]
    monkeypatch.setattr(mod, "_index_scores_kernel", lambda *refs, **kw: None)
    q, w, k = indexer_inputs(5, 20, 40, 2, 16)
    # A config no other test uses, so jit traces afresh with the broken kernel.
    out = mod.index_scores_pallas(q, w, k, 0, config=IndexScoresConfig(16, 16, num_warps=2),
                                  interpret=True, poison=POISON)
    assert np.isnan(np.asarray(out)).all()


def test_non_causal():
    q, w, k = indexer_inputs(6, 40, 70, 3, 32)
    out = index_scores_pallas(q, w, k, causal=False, config=SMALL, interpret=True,
                              poison=POISON)
    ref = index_scores_reference(q, w, k, causal=False)
    assert np.isfinite(np.asarray(ref)).all()
    assert_scores_match(out, ref)


def test_traced_q_offset_chunks():
    """q_offset is a runtime value: one compiled kernel serves every prefill chunk."""
    q, w, k = indexer_inputs(7, 48, 96, 2, 16)
    f = jax.jit(lambda qc, wc, off: index_scores_pallas(qc, wc, k, off, config=SMALL,
                                                         interpret=True, poison=POISON))
    for start in (0, 16, 32):
        out = f(q[start:start + 16], w[start:start + 16], jnp.int32(start))
        ref = index_scores_reference(q[start:start + 16], w[start:start + 16], k,
                                     q_offset=start)
        assert_scores_match(out, ref)


def test_vmap_over_sequences():
    q, w, k = indexer_inputs(8, 24, 40, 2, 16)
    q2, w2, k2 = indexer_inputs(9, 24, 40, 2, 16)
    qs, ws, ks = jnp.stack([q, q2]), jnp.stack([w, w2]), jnp.stack([k, k2])
    offs = jnp.array([0, 16], jnp.int32)
    out = jax.vmap(lambda a, b, c, o: index_scores_pallas(a, b, c, o, config=TINY,
                                                          interpret=True))(qs, ws, ks, offs)
    for i in range(2):
        ref = index_scores_reference(qs[i], ws[i], ks[i], q_offset=int(offs[i]))
        assert_scores_match(out[i], ref)


def test_api_dispatch():
    q, w, k = indexer_inputs(10, 20, 30, 2, 16)
    assert pallas_kernels.resolve("index_scores") == (
        "pallas" if jax.default_backend() == "gpu" else "xla")
    xla = pallas_kernels.index_scores(q, w, k, q_offset=5, backend="xla")
    interp = pallas_kernels.index_scores(q, w, k, q_offset=5, backend="interpret")
    assert_scores_match(interp, xla)
    coarse = pallas_kernels.index_scores(q, w, k, q_offset=5, key_block_size=4,
                                         backend="interpret")
    assert_scores_match(coarse, index_scores_reference(q, w, k, q_offset=5,
                                                       key_block_size=4))
    with pytest.raises(ValueError):
        pallas_kernels.index_scores(q, w, k, backend="cuda")


def test_tile_sizes_must_be_powers_of_two():
    with pytest.raises(ValueError, match="power of two"):
        IndexScoresConfig(block_q=48)


def test_tpu_interpreter_bounds_checked():
    """The TPU interpreter raises on out-of-range block reads (the plain one clamps)."""
    q, w, k = indexer_inputs(11, 20, 40, 2, 16)
    out = index_scores_pallas(q, w, k, 7, config=TINY, interpret=pltpu.InterpretParams(),
                              poison=POISON)
    assert_scores_match(out, index_scores_reference(q, w, k, q_offset=7))
