"""Attention over each query's selected tokens (DSA main attention).

`sparse_attention_reference` is plain jnp; `sparse_attention_pallas` is the Triton-backend
Pallas kernel: one program per (query, kv head) holds the query rows of the heads that
share that kv head (up to block_h of them; the selection is shared across heads, so one
gather serves them all),
walks the query's index list in chunks of `block_k`, gathers the selected K and V rows and
runs a flash-style online softmax with fp32 statistics and accumulator. -1 entries are
masked out; each query's loop stops after its last valid entry; a query with none returns
zeros.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    check_pow2,
    compiler_params,
    dot_dim,
    dot_nn,
    dot_t,
    pad_axis,
    round_up,
)


def sparse_attention_reference(q, k, v, indices, *, scale=None):
    """q: [T, H, D], k: [L, H_kv, D], v: [L, H_kv, Dv], indices: i32[T, K] -> [T, H, Dv].

    Every head of query t attends to the tokens indices[t] (shared across heads, GQA:
    head h reads kv head h // (H // H_kv)); -1 entries are never attended. A row with no
    valid index returns zeros. Softmax in fp32; output in q's dtype.
    """
    T, H, D = q.shape
    H_kv = k.shape[1]
    if H % H_kv:
        raise ValueError(f"number of query heads H={H} must be a multiple of H_kv={H_kv}")
    scale = D**-0.5 if scale is None else scale
    valid = indices >= 0
    safe = jnp.where(valid, indices, 0)
    k_sel = k[safe]  # [T, K, H_kv, D]
    v_sel = v[safe]  # [T, K, H_kv, Dv]
    qg = q.reshape(T, H_kv, H // H_kv, D)
    logits = jnp.einsum("tgrd,tkgd->tgrk", qg, k_sel, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tgrk,tkgd->tgrd", p, v_sel.astype(jnp.float32))
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(T, H, v.shape[-1]).astype(q.dtype)


def sparse_attention_masked(q, k, v, indices, *, scale=None):
    """sparse_attention_reference computed as dense attention weighted by how often each
    token is selected (0: masked; a repeated index counts as often as the gather reads it):
    the same softmax over the same entries. On CPU, when the selection is a large share of
    the keys, reading the keys in order beats gathering [T, K] rows of them (the xla
    backend's choice, pallas_kernels.api.sparse_attention)."""
    T, H, D = q.shape
    L, H_kv = k.shape[:2]
    if H % H_kv:
        raise ValueError(f"number of query heads H={H} must be a multiple of H_kv={H_kv}")
    scale = D**-0.5 if scale is None else scale
    valid = indices >= 0
    rows = jnp.broadcast_to(jnp.arange(T)[:, None], indices.shape)
    count = jnp.zeros((T, L), jnp.float32).at[rows, jnp.where(valid, indices, 0)].add(
        valid.astype(jnp.float32))
    qg = q.reshape(T, H_kv, H // H_kv, D)
    logits = jnp.einsum("tgrd,lgd->tgrl", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(count[:, None, None, :] > 0, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m) * count[:, None, None, :]
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tgrl,lgd->tgrd", p, v.astype(jnp.float32))
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(T, H, v.shape[-1]).astype(q.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class SparseAttentionConfig:
    """Chunk sizes and Triton launch parameters of the sparse-attention kernel.

    block_k: selected tokens gathered per step (power of two >= 16). Shared memory per
      stage is about block_k * (D + Dv) * itemsize (64 KiB at 128 x (128 + 128) bf16).
    block_h: query heads per program (power of two >= 16). A kv head's group of
      G = H // H_kv query heads is split into programs of block_h heads (each re-gathers
      the same rows, from L2), which bounds the [block_h, D] query tile and the
      [block_h, Dv] f32 accumulator for MQA-style groups of 64-128 heads.
    skip_empty_chunks: also skip, inside the loop, any chunk whose entries are all -1 (a
      branch per chunk, which can keep Triton from pipelining the gathers). Without it
      only the trailing all -1 chunks are skipped: each query's loop ends at its last
      valid entry, which the wrapper finds (selectors put their -1 padding last).
    num_warps, num_stages: Triton launch parameters.
    """

    # Defaults measured on an H200 (skip_empty_chunks=True about 2x slower there):
    # docs/findings.md, "Kernel defaults".
    block_k: int = 128
    block_h: int = 64
    num_warps: int = 8
    num_stages: int = 2
    skip_empty_chunks: bool = False

    def __post_init__(self):
        check_pow2("block_k", self.block_k)
        check_pow2("block_h", self.block_h)


DEFAULT_CONFIG = SparseAttentionConfig()


def _sparse_attention_kernel(cnt_ref, q_ref, idx_ref, k_ref, v_ref, *rest, scale, key_len,
                             block_k, skip_empty_chunks):
    """One (query t, kv head g, head block) program.

    cnt_ref i32[1]: chunks of block_k entries up to this query's last valid one;
    q_ref [bh, D] (bh of the query heads reading kv head g; padded to >= 16 rows);
    idx_ref i32[K] (this query's selection, padded with -1 to a multiple of block_k);
    k_ref [L, D], v_ref [L, Dv] (kv head g; rows are gathered); rest: (optional aliased
    poison input, unused), o_ref [bh, Dv].
    """
    o_ref = rest[-1]
    bh, Dv = o_ref.shape
    q = q_ref[...]  # [bh, D], loaded once, reused for every chunk

    def body(c, carry):
        idx = idx_ref[pl.ds(c * block_k, block_k)]
        valid = idx >= 0
        # Clamped gather: in range whatever the index holds (jnp's gather clamps too, so
        # the reference agrees); -1 entries are masked out of the softmax below.
        safe = jnp.clip(idx, 0, key_len - 1)

        def step(carry):
            acc, m_prev, l_prev = carry
            k = k_ref[safe, :]  # [block_k, D]
            s = dot_t(q, k) * scale  # [bh, block_k] f32
            s = jnp.where(valid[None, :], s, -jnp.inf)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
            # Rows that have seen no valid entry yet keep m = -inf; subtract 0 there so
            # exp() gives 0 instead of NaN.
            m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m_prev - m_sub)
            p = jnp.exp(s - m_sub[:, None])
            v = v_ref[safe, :]  # [block_k, Dv]
            acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
            return acc, m_new, l_prev * alpha + jnp.sum(p, axis=1)

        if not skip_empty_chunks:
            return step(carry)
        any_valid = jnp.max(jnp.where(valid, 1, 0)) > 0
        return lax.cond(any_valid, step, lambda carry: carry, carry)

    init = (jnp.zeros((bh, Dv), jnp.float32),
            jnp.full((bh,), -jnp.inf, jnp.float32),
            jnp.zeros((bh,), jnp.float32))
    # Dynamic trip count: a query with 100 selected tokens does 2 chunks, not K / block_k.
    acc, _, denom = lax.fori_loop(0, cnt_ref[0], body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]  # no valid entry at all -> zeros
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "config", "interpret", "poison"))
def sparse_attention_pallas(q, k, v, indices, *, scale=None,
                            config: SparseAttentionConfig = DEFAULT_CONFIG,
                            interpret=False, poison=None):
    """Pallas version of `sparse_attention_reference` (same arguments and result).

    q: [T, H, D], k: [L, H_kv, D], v: [L, H_kv, Dv], indices: i32[T, K] -> [T, H, Dv] in
    q's dtype. interpret / poison: as in `index_scores_pallas`.
    """
    T, H, D = q.shape
    L, H_kv, Dk = k.shape
    Dv = v.shape[-1]
    if H % H_kv:
        raise ValueError(f"number of query heads H={H} must be a multiple of H_kv={H_kv}")
    if Dk != D or v.shape[:2] != (L, H_kv) or indices.shape[0] != T:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}, "
                         f"indices {indices.shape}")
    scale = D**-0.5 if scale is None else scale
    K = indices.shape[1]
    if T == 0 or L == 0 or K == 0:
        return jnp.zeros((T, H, Dv), q.dtype)
    G = H // H_kv
    Gp, Dp, Dvp = dot_dim(G), dot_dim(D), dot_dim(Dv)
    bh = max(16, min(config.block_h, Gp))
    bk = max(16, min(config.block_k, dot_dim(K)))
    # Keep a stage's gathered K and V rows within the default's 64 KiB (128 x (128 + 128)
    # bf16) when the heads are wider, e.g. absorbed MLA's 576 (padded 1024) + 512 dims.
    row_bytes = (Dp + Dvp) * jnp.dtype(jnp.promote_types(q.dtype, k.dtype)).itemsize
    while bk > 16 and bk * row_bytes > 65536:
        bk //= 2
    Kp = round_up(K, bk)
    dtype = jnp.promote_types(q.dtype, k.dtype)

    qp = pad_axis(pad_axis(q.astype(dtype).reshape(T, H_kv, G, D), 2, Gp), 3, Dp)
    kp = pad_axis(k.astype(dtype), 2, Dp)
    vp = pad_axis(v.astype(dtype), 2, Dvp)
    ip = pad_axis(indices.astype(jnp.int32), 1, Kp, value=-1)
    out_dtype = q.dtype
    # Chunks up to each query's last valid entry (0 for a row of -1).
    last = jnp.max(jnp.where(ip >= 0, jnp.arange(1, Kp + 1, dtype=jnp.int32), 0), axis=1)
    counts = (last + bk - 1) // bk

    args = [counts, qp, ip, kp, vp]
    in_specs = [
        pl.BlockSpec((1,), lambda t, g, b: (t,)),
        pl.BlockSpec((None, None, bh, Dp), lambda t, g, b: (t, g, b, 0)),
        pl.BlockSpec((None, Kp), lambda t, g, b: (t, 0)),
        pl.BlockSpec((L, None, Dp), lambda t, g, b: (0, g, 0)),
        pl.BlockSpec((L, None, Dvp), lambda t, g, b: (0, g, 0)),
    ]
    out_spec = pl.BlockSpec((None, None, bh, Dvp), lambda t, g, b: (t, g, b, 0))
    aliases = {}
    if poison is not None:
        args.append(jnp.full((T, H_kv, Gp, Dvp), poison, out_dtype))
        in_specs.append(out_spec)
        aliases = {len(args) - 1: 0}

    kernel = functools.partial(_sparse_attention_kernel, scale=float(scale), key_len=L,
                               block_k=bk, skip_empty_chunks=config.skip_empty_chunks)
    out = pl.pallas_call(
        kernel,
        grid=(T, H_kv, Gp // bh),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((T, H_kv, Gp, Dvp), out_dtype),
        input_output_aliases=aliases,
        compiler_params=compiler_params(config.num_warps, config.num_stages, interpret),
        interpret=interpret,
        name="sparse_attention",
    )(*args)
    return out[:, :, :G, :Dv].reshape(T, H, Dv)
