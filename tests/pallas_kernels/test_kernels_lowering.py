"""Every kernel lowers to a Triton custom call for A100 and H100, from this CPU machine.

Catches Pallas -> Triton errors (non-power-of-two tiles, unsupported primitives) without a
GPU; it cannot catch ptxas or shared-memory limits, which only a GPU run (bench) finds.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.gathered_index_scores import gathered_index_scores_pallas
from pallas_kernels.grouped_matmul import grouped_matmul_pallas
from pallas_kernels.index_scores import index_scores_pallas
from pallas_kernels.sparse_attention import sparse_attention_pallas
from tests.pallas_kernels.test_kernels_common import DEVICE_KINDS, TRITON_MARKER, lower_for_cuda

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32

# Indexer shapes: small (H_I=4, d_I=64) and DeepSeek-V3.2 (H_I=64, d_I=128), a prefill chunk
# of 4096 queries against 64K keys (bf16) and a ragged f32 case that needs padding.
INDEXER_SHAPES = {
    "small": (4, 64, 1000, 3000, BF16),
    "v32": (64, 128, 4096, 65536, BF16),
    "v32-ragged-f32": (64, 128, 1000, 5000, F32),
}
# Main attention shapes for sparse attention: (H, H_kv, D, T, L, K).
ATTENTION_SHAPES = {
    "small": (4, 1, 64, 1000, 3000, 256),
    "bench": (16, 1, 128, 4096, 65536, 2048),
    "mqa-128-heads": (128, 1, 128, 1024, 65536, 2048),
    # V3.2's absorbed MLA: 128 heads over one latent key of 512 + 64 = 576 dims (padded to
    # 1024 for Triton's power-of-two tiles), values the 512-dim latent.
    "mla-absorbed": (128, 1, 576, 256, 32768, 2048, 512),
}


def _index_scores(shape):
    H, D, T, L, dt = INDEXER_SHAPES[shape]
    structs = (S((T, H, D), dt), S((T, H), F32), S((L, D), dt), S((), I32))
    return (lambda q, w, k, off: index_scores_pallas(q, w, k, off)), structs


def _coarse_scores(shape):
    H, D, T, L, dt = INDEXER_SHAPES[shape]
    structs = (S((T, H, D), dt), S((T, H), F32), S((L // 64, D), dt), S((), I32))
    return (lambda q, w, k, off: index_scores_pallas(q, w, k, off, key_block_size=64)), structs


def _gathered(shape):
    H, D, T, L, dt = INDEXER_SHAPES[shape]
    T = T // 64 * 64
    structs = (S((T, H, D), dt), S((T, H), F32), S((L, D), dt), S((T // 64, 128), I32),
               S((), I32))
    return (lambda q, w, k, bt, off: gathered_index_scores_pallas(
        q, w, k, bt, off, block_size=64)), structs


def _sparse(shape):
    H, H_kv, D, T, L, K, *Dv = ATTENTION_SHAPES[shape]
    Dv = Dv[0] if Dv else D
    structs = (S((T, H, D), BF16), S((L, H_kv, D), BF16), S((L, H_kv, Dv), BF16),
               S((T, K), I32))
    return sparse_attention_pallas, structs


# Grouped matmul (the MoE's expert product): (M, K, N, G, FP8 block scales): DeepSeek-V3.2's
# gate of a 4096-token chunk x 8 experts, its down projection with FP8 experts, and a
# ragged f32 case that needs padding.
GROUPED_SHAPES = {
    "v32-gate": (32768, 7168, 2048, 256, None),
    "v32-down-fp8": (32768, 2048, 7168, 256, (128, 128)),
    "ragged-f32": (1000, 200, 300, 7, None),
}


def _grouped(shape):
    M, K, N, G, block = GROUPED_SHAPES[shape]
    if block is None:
        dt = F32 if shape.endswith("f32") else BF16
        structs = (S((M, K), dt), S((G, K, N), dt), S((G,), I32))
        return grouped_matmul_pallas, structs
    structs = (S((M, K), BF16), S((G, K, N), jnp.float8_e4m3fn),
               S((G, K // block[0], N // block[1]), F32), S((G,), I32))
    return (lambda x, w, s, g: grouped_matmul_pallas(x, w, g, rhs_scale=s,
                                                     scale_block=block)), structs


CASES = ([("index_scores", _index_scores, s) for s in INDEXER_SHAPES]
         + [("index_scores_coarse", _coarse_scores, s) for s in ("small", "v32")]
         + [("gathered_index_scores", _gathered, s) for s in INDEXER_SHAPES]
         + [("sparse_attention", _sparse, s) for s in ATTENTION_SHAPES]
         + [("grouped_matmul", _grouped, s) for s in GROUPED_SHAPES])


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("name,make,shape", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_lowers_to_triton(name, make, shape, device_kind):
    f, structs = make(shape)
    text = lower_for_cuda(f, *structs, device_kind=device_kind)
    assert TRITON_MARKER in text, f"{name} ({shape}) did not lower to a Triton call"
