"""The correctness section of `python -m pallas_kernels.bench`: every kernel against its
jnp reference on fresh random inputs (lengths that are not tile multiples), outputs
poisoned (NaN) before the call so an unwritten tile shows; also the public dispatch under
jit + vmap with a traced q_offset. Each case reports its max abs error and whether the
-inf masks match; one failing case never stops the others.
"""

import time

import jax
import jax.numpy as jnp

from pallas_kernels.bench_support import max_err, rand_inputs, random_selection
from pallas_kernels.gathered_index_scores import (
    gathered_index_scores_pallas, gathered_index_scores_reference)
from pallas_kernels.index_scores import index_scores_pallas, index_scores_reference
from pallas_kernels.sparse_attention import sparse_attention_pallas, sparse_attention_reference


def section_correctness(rep, args, kern):
    L = args.correctness_len
    H, D, B = args.heads, args.dim, args.block
    T = max(args.query_tile, min(1024, L // 2) // args.query_tile * args.query_tile)
    key = jax.random.key(int(time.time()) % 100000)  # fresh inputs every run
    ks = jax.random.split(key, 8)
    poison = float("nan")
    interp = kern.interpret

    def record(name, out, ref, rtol=1e-3):
        # f32 outputs: summation order only (1e-3 of the largest entry is generous);
        # bf16 outputs (sparse attention returns q's dtype): a couple of bf16 ulps.
        err, scale, masks, nan = max_err(out, ref)
        ok = masks and not nan and err <= rtol * max(scale, 1.0)
        rep.data["correctness"].append(dict(name=name, max_abs_err=err, max_abs_ref=scale,
                                            masks_match=masks, nan=nan, ok=ok))
        print(f"[correctness] {name}: max abs err {err:.3e} (max |ref| {scale:.3e}), "
              f"masks {'match' if masks else 'DIFFER'}, {'NaN!' if nan else 'no NaN'}"
              f" -> {'OK' if ok else 'FAIL'}", flush=True)

    cases = [
        ("index_scores bf16 last chunk", jnp.bfloat16, L + 37, L + 37 - T, 1),
        ("index_scores f32 q_offset=0", jnp.float32, T + 5, 0, 1),
        ("index_scores coarse (key_block_size=B)", jnp.bfloat16, (L + 37) // B + 1,
         L + 37 - T, B),
    ]
    for i, (name, dtype, Lk, off, kbs) in enumerate(cases):
        try:
            q, w, k = rand_inputs(ks[i], T, Lk, H, D, dtype)
            if kern.backend == "xla":
                out = kern.scores(q, w, k, off, kbs)
            else:
                out = index_scores_pallas(q, w, k, off, key_block_size=kbs,
                                          config=kern.index_cfg, interpret=interp,
                                          poison=poison)
            record(name, out, index_scores_reference(q, w, k, q_offset=off,
                                                     key_block_size=kbs))
        except Exception as e:  # noqa: BLE001 - report and go on
            rep.error(f"correctness/{name}", e)

    try:
        Lk = L + 37
        off = Lk - T
        q, w, k = rand_inputs(ks[4], T, Lk, H, D, jnp.bfloat16)
        n_tiles = T // args.query_tile
        nb = -(-Lk // B)
        n_cand = min(nb, args.cand_factor * args.top_k // B)
        bt = jax.random.randint(ks[5], (n_tiles, n_cand), -1, nb)
        ref = gathered_index_scores_reference(q, w, k, bt, block_size=B, q_offset=off)
        if kern.backend == "xla":
            out = kern.gathered(q, w, k, bt, off, B)
        else:
            out = gathered_index_scores_pallas(q, w, k, bt, off, block_size=B,
                                               config=kern.gather_cfg, interpret=interp,
                                               poison=poison)
        record("gathered_index_scores bf16", out, ref)
    except Exception as e:  # noqa: BLE001
        rep.error("correctness/gathered_index_scores", e)

    try:
        # Through the public dispatch (backend=None: pallas on GPU), jitted with a traced
        # q_offset and vmapped over two sequences, as indexer/ and model/ call it.
        import pallas_kernels
        Ta, La = T // 2, L // 2
        q, w, k = rand_inputs(ks[7], 2 * Ta, La, H, D, jnp.bfloat16)
        qs, ws = q.reshape(2, Ta, H, D), w.reshape(2, Ta, H)
        kk = jnp.stack([k, k[::-1]])
        offs = jnp.array([La - Ta, La // 3], jnp.int32)
        api_backend = None if kern.backend == "pallas" else kern.backend
        f = jax.jit(jax.vmap(lambda q, w, k, o: pallas_kernels.index_scores(
            q, w, k, q_offset=o, backend=api_backend)))
        out = f(qs, ws, kk, offs)
        ref = jnp.stack([index_scores_reference(qs[i], ws[i], kk[i], q_offset=offs[i])
                         for i in range(2)])
        record("api index_scores jit+vmap, traced q_offset", out, ref)
    except Exception as e:  # noqa: BLE001
        rep.error("correctness/api", e)

    for i, (Hq, Hkv) in enumerate([(args.attn_heads, args.attn_kv_heads), (8, 2)]):
        name = f"sparse_attention bf16 H={Hq} H_kv={Hkv}"
        try:
            Ts, Dh = min(T, 512), args.attn_dim
            kq, kk, kv, ki = jax.random.split(ks[6 + i], 4)
            q = jax.random.normal(kq, (Ts, Hq, Dh), jnp.float32).astype(jnp.bfloat16)
            k = jax.random.normal(kk, (L, Hkv, Dh), jnp.float32).astype(jnp.bfloat16)
            v = jax.random.normal(kv, (L, Hkv, Dh), jnp.float32).astype(jnp.bfloat16)
            idx = random_selection(ki, Ts, min(args.top_k, L), L)
            idx = idx.at[3].set(-1)  # one query with nothing selected -> zeros
            ref = sparse_attention_reference(q, k, v, idx)
            if kern.backend == "xla":
                out = kern.sparse(q, k, v, idx)
            else:
                out = sparse_attention_pallas(q, k, v, idx, config=kern.sparse_cfg,
                                              interpret=interp, poison=poison)
            record(name, out, ref, rtol=1.6e-2)
        except Exception as e:  # noqa: BLE001
            rep.error(f"correctness/{name}", e)
