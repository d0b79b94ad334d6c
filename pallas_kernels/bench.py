"""Kernel benchmark: correctness against the references, then speed, side by side.

GPU (the default when one is present):

    PYTHONPATH=. python3 -m pallas_kernels.bench                 # 32K, 64K, 128K tokens
    PYTHONPATH=. python3 -m pallas_kernels.bench --lengths 32768 --no-tune

CPU smoke run (tiny sizes, Pallas interpreter or the jnp references; what the tests run):

    python -m pallas_kernels.bench --smoke [--backend xla]

Sections, each wrapped so that one failure still lets the others report:
  env          jax version, device kind
  matmul       bf16 [n, n] x [n, n] jnp.dot rate: the yardstick for every "frac" column
  correctness  every kernel vs its jnp reference on fresh random inputs, outputs poisoned
               (NaN) before the call so an unwritten tile shows; max abs error printed
  tune         a few tile configurations per kernel at the shortest length; the fastest
               is used below (--no-tune keeps the defaults)
  scores       index_scores, V3.2 indexer dims, on the last query chunk (the costliest:
               it sees every key), Pallas vs the jnp/XLA reference. The reference
               materialises [T, H_I, L] f32, so it is timed on a smaller query slice and
               scaled linearly (it computes every (query, key) pair, causal or not); the
               output says so. Also the Pallas scores of the whole causal sequence,
               chunked as prefill does, to show the skipped upper tiles.
  select       whole-sequence top-k selection (prefill of L tokens in query chunks):
               flat = index_scores + lax.top_k over all L keys, vs hierarchical = mean-
               pooled key blocks scored by index_scores (coarse, block-causal), the best
               candidate blocks per query tile by lax.top_k, gathered_index_scores over
               them (fine), lax.top_k.
  attention    sparse_attention over top_k selected tokens per query vs dense causal
               jax.nn.dot_product_attention (cuDNN on GPU), whole sequence.
JSON goes to $OUT/bench.json when $OUT is set, else ./results/bench.json; a table is printed
last. Every section checks a deadline (--budget seconds) and skips what would not fit.

Measured on one H200 (jax 0.11.2, 2026-11-30; whole run 75 s): bf16 matmul yardstick
701 TFLOP/s; index_scores 564-599 TFLOP/s on the last 4K-query chunk (0.80-0.85 of it) and
534-548 TFLOP/s over whole causal sequences at 32K-128K, 10-11x the XLA reference;
hierarchical vs flat selection 2.8x (32K), 5.4x (64K), 10.5x (128K) faster, flat being
dominated by lax.top_k over [4096, L]; sparse attention (H=16, one kv head, D=128,
top_k=2048) 99-106 TFLOP/s, 1.4x / 2.9x / 5.8x faster than cuDNN dense causal attention.
"""

import argparse
import dataclasses
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.bench_correctness import section_correctness
from pallas_kernels.bench_support import (
    Kernels, Report, make_flat, make_hierarchical, rand_inputs, random_selection, timeit,
    visible_pairs)
from pallas_kernels.gathered_index_scores import GatheredScoresConfig, gathered_index_scores_pallas
from pallas_kernels.index_scores import (
    IndexScoresConfig, index_scores_pallas, index_scores_reference)
from pallas_kernels.sparse_attention import SparseAttentionConfig, sparse_attention_pallas

# --------------------------------------------------------------------------- settings

GPU_DEFAULTS = dict(lengths="32768,65536,131072", heads=64, dim=128, top_k=2048,
                    chunk=4096, block=64, query_tile=64, cand_factor=4, attn_heads=16,
                    attn_kv_heads=1, attn_dim=128, matmul_n=8192, reps=10, budget=330.0,
                    xla_slice_bytes=4 << 30, correctness_len=4096)
SMOKE_DEFAULTS = dict(lengths="256,512", heads=4, dim=32, top_k=32, chunk=128, block=16,
                      query_tile=16, cand_factor=4, attn_heads=4, attn_kv_heads=1,
                      attn_dim=32, matmul_n=256, reps=2, budget=120.0,
                      xla_slice_bytes=1 << 22, correctness_len=200)

# Candidates tried by the tune section (the first of each list is the file's default).
INDEX_TUNE = [IndexScoresConfig(64, 128, 4, 2), IndexScoresConfig(64, 128, 4, 3),
              IndexScoresConfig(64, 128, 8, 2), IndexScoresConfig(128, 128, 8, 2),
              IndexScoresConfig(64, 64, 4, 2)]
GATHER_TUNE = [GatheredScoresConfig(64, 128, 8, 3), GatheredScoresConfig(64, 128, 4, 2),
               GatheredScoresConfig(64, 128, 8, 2), GatheredScoresConfig(128, 128, 8, 3)]
SPARSE_TUNE = [SparseAttentionConfig(128, 64, 8, 2), SparseAttentionConfig(64, 64, 4, 3),
               SparseAttentionConfig(64, 64, 4, 2),
               SparseAttentionConfig(128, 64, 8, 2, skip_empty_chunks=True)]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny CPU sizes (tests)")
    p.add_argument("--backend", choices=("pallas", "interpret", "xla"), default=None,
                   help="kernel backend (default: pallas on GPU, interpret otherwise)")
    p.add_argument("--lengths", help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, help="indexer heads H_I")
    p.add_argument("--dim", type=int, help="indexer head dim d_I")
    p.add_argument("--top-k", dest="top_k", type=int)
    p.add_argument("--chunk", type=int, help="prefill query chunk")
    p.add_argument("--block", type=int, help="key block size B of the hierarchical indexer")
    p.add_argument("--query-tile", dest="query_tile", type=int,
                   help="queries sharing one candidate set")
    p.add_argument("--cand-factor", dest="cand_factor", type=int,
                   help="candidate tokens = cand_factor * top_k")
    p.add_argument("--attn-heads", dest="attn_heads", type=int)
    p.add_argument("--attn-kv-heads", dest="attn_kv_heads", type=int)
    p.add_argument("--attn-dim", dest="attn_dim", type=int)
    p.add_argument("--matmul-n", dest="matmul_n", type=int)
    p.add_argument("--reps", type=int, help="timed repetitions (median reported)")
    p.add_argument("--budget", type=float, help="seconds; later sections are skipped after")
    p.add_argument("--correctness-len", dest="correctness_len", type=int)
    p.add_argument("--sections", default="matmul,correctness,tune,scores,select,attention")
    p.add_argument("--no-tune", dest="tune", action="store_false")
    p.add_argument("--out", help="JSON path (default $OUT/bench.json or results/bench.json)")
    args = p.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    args.sections = set(args.sections.split(","))
    if args.backend is None:
        args.backend = "pallas" if jax.default_backend() == "gpu" else "interpret"
    if args.smoke:
        args.tune = False
    return args


# --------------------------------------------------------------------------- sections

def section_env(rep):
    dev = jax.devices()[0]
    rep.data["env"] = {"jax": jax.__version__, "backend": jax.default_backend(),
                       "device_kind": dev.device_kind, "python": sys.version.split()[0]}
    print(f"[env] {rep.data['env']}", flush=True)


def section_matmul(rep, args, chain=8):
    """bf16 [n, n] @ [n, n] rate: `chain` dependent jnp.dot calls in one jit, so the
    per-call dispatch and sync (which the kernel timings also carry, once per call) do
    not dilute the yardstick. b is scaled by n^-1/2 so the chain stays O(1) (no inf)."""
    n = args.matmul_n
    ka, kb = jax.random.split(jax.random.key(7))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (n, n), jnp.float32) * n**-0.5).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: lax.fori_loop(0, chain, lambda i, x: jnp.dot(x, b), a))
    t, _ = timeit(f, a, b, reps=max(args.reps, 10))
    rate = chain * 2 * n**3 / t / 1e12
    rep.data["env"]["matmul_tflops"] = rate
    rep.row(section="matmul", name=f"bf16 jnp.dot {n}^3 (x{chain} chained)", L=n,
            time_s=t / chain, tflops=round(rate, 1))
    return rate


def section_tune(rep, args, kern):
    """Fastest config per kernel at the shortest length (last chunk / whole sequence)."""
    L = min(args.lengths)
    H, D, B, Tc = args.heads, args.dim, args.block, args.chunk
    q, w, k = rand_inputs(jax.random.key(11), Tc, L, H, D, jnp.bfloat16)
    off = L - Tc
    flops = 2.0 * H * D * visible_pairs(Tc, L, off)
    best = {}

    def trial(kind, cfg, f, *a, flop):
        if rep.over_budget(f"tune {kind} {cfg}"):
            return
        try:
            if kind not in best:  # the first config of a list measured slow: warm up more
                for _ in range(3):
                    jax.block_until_ready(f(*a))
            t, first = timeit(f, *a, reps=5, target_s=0.5)
            rep.data["tuning"].append(dict(kernel=kind, config=dataclasses.asdict(cfg),
                                           time_s=t, tflops=flop / t / 1e12,
                                           first_call_s=first))
            print(f"[tune] {kind} {cfg}: {t * 1e3:.3f} ms, {flop / t / 1e12:.1f} TFLOP/s",
                  flush=True)
            if kind not in best or t < best[kind][0]:
                best[kind] = (t, cfg)
        except Exception as e:  # noqa: BLE001
            rep.error(f"tune/{kind}/{cfg}", e)

    for cfg in INDEX_TUNE:
        f = jax.jit(lambda q, w, k, cfg=cfg: index_scores_pallas(q, w, k, off, config=cfg))
        trial("index_scores", cfg, f, q, w, k, flop=flops)

    n_tiles = Tc // args.query_tile
    nb = L // B
    n_cand = min(nb, args.cand_factor * args.top_k // B)
    bt = jnp.sort(jax.random.randint(jax.random.key(12), (n_tiles, n_cand), 0, nb), axis=1)
    gflops = 2.0 * H * D * Tc * n_cand * B
    for cfg in GATHER_TUNE:
        f = jax.jit(lambda q, w, k, bt, cfg=cfg: gathered_index_scores_pallas(
            q, w, k, bt, off, block_size=B, config=cfg))
        trial("gathered_index_scores", cfg, f, q, w, k, bt, flop=gflops)

    Hq, Hkv, Dh, K = args.attn_heads, args.attn_kv_heads, args.attn_dim, args.top_k
    ka, kb, kc, kd = jax.random.split(jax.random.key(13), 4)
    qa = jax.random.normal(ka, (Tc, Hq, Dh), jnp.float32).astype(jnp.bfloat16)
    kk = jax.random.normal(kb, (L, Hkv, Dh), jnp.float32).astype(jnp.bfloat16)
    vv = jax.random.normal(kc, (L, Hkv, Dh), jnp.float32).astype(jnp.bfloat16)
    idx = random_selection(kd, L, K, L)[L - Tc:]
    aflops = 4.0 * Tc * K * Hq * Dh
    for cfg in SPARSE_TUNE:
        f = jax.jit(lambda q, k, v, i, cfg=cfg: sparse_attention_pallas(q, k, v, i, config=cfg))
        trial("sparse_attention", cfg, f, qa, kk, vv, idx, flop=aflops)

    if "index_scores" in best:
        kern.index_cfg = best["index_scores"][1]
    if "gathered_index_scores" in best:
        kern.gather_cfg = best["gathered_index_scores"][1]
    if "sparse_attention" in best:
        kern.sparse_cfg = best["sparse_attention"][1]
    rep.data["tuned"] = {k: dataclasses.asdict(v[1]) for k, v in best.items()}
    print(f"[tune] chosen: {rep.data['tuned']}", flush=True)


def section_scores(rep, args, kern, L, mm_rate):
    H, D, Tc = args.heads, args.dim, min(args.chunk, L)
    q, w, k = rand_inputs(jax.random.key(L), L, L, H, D, jnp.bfloat16)
    off = L - Tc
    qc, wc = q[off:], w[off:]
    flops = 2.0 * H * D * visible_pairs(Tc, L, off)

    def frac(t, fl):
        return None if not mm_rate else round(fl / t / 1e12 / mm_rate, 3)

    try:
        f = jax.jit(lambda q, w, k: kern.scores(q, w, k, off))
        t, first = timeit(f, qc, wc, k, reps=args.reps)
        rep.row(section="scores", name=f"{kern.backend} index_scores last {Tc} queries",
                L=L, time_s=t, tflops=round(flops / t / 1e12, 1), frac_matmul=frac(t, flops),
                first_call_s=round(first, 2))
    except Exception as e:  # noqa: BLE001
        rep.error(f"scores/{kern.backend}/L={L}", e)

    if not rep.over_budget(f"scores xla L={L}"):
        try:
            # [Ts, H, L] f32 logits must fit: time a slice of the chunk and scale.
            Ts = max(1, min(Tc, args.xla_slice_bytes // (H * L * 4)))
            offx = L - Ts
            f = jax.jit(lambda q, w, k: index_scores_reference(q, w, k, q_offset=offx))
            t, first = timeit(f, q[offx:], w[offx:], k, reps=args.reps)
            scaled = t * Tc / Ts
            rep.row(section="scores", name=f"xla reference last {Tc} queries", L=L,
                    time_s=scaled, tflops=round(flops / scaled / 1e12, 1),
                    frac_matmul=frac(scaled, flops),
                    note=f"timed on the last {Ts} queries ({t * 1e3:.3f} ms), scaled x{Tc / Ts:g}")
        except Exception as e:  # noqa: BLE001
            rep.error(f"scores/xla/L={L}", e)

    if kern.backend != "xla" and not rep.over_budget(f"scores whole sequence L={L}"):
        try:
            f = make_flat(kern, args.top_k, Tc, scores_only=True)
            t, first = timeit(f, q, w, k, reps=args.reps)
            fl = 2.0 * H * D * visible_pairs(L, L, 0)
            rep.row(section="scores", name=f"{kern.backend} index_scores whole causal sequence",
                    L=L, time_s=t, tflops=round(fl / t / 1e12, 1), frac_matmul=frac(t, fl),
                    note=f"{L // Tc} chunks of {Tc}; + a row max per chunk")
        except Exception as e:  # noqa: BLE001
            rep.error(f"scores/whole/L={L}", e)
    return q, w, k


def section_select(rep, args, kern, L, q, w, k):
    Tc, B = min(args.chunk, L), args.block
    n_cand = args.cand_factor * args.top_k // B
    times = {}
    for name, make in [
        ("flat", lambda: make_flat(kern, args.top_k, Tc)),
        ("hierarchical", lambda: make_hierarchical(kern, args.top_k, Tc, B=B,
                                                   query_tile=args.query_tile,
                                                   n_cand=n_cand)),
    ]:
        if rep.over_budget(f"select {name} L={L}"):
            continue
        try:
            f = make()
            t, first = timeit(f, q, w, k, reps=args.reps, target_s=3.0)
            times[name] = t
            rep.row(section="select", name=f"{name} ({kern.backend})", L=L, time_s=t,
                    first_call_s=round(first, 2),
                    note=(f"{L // Tc} chunks of {Tc}; top_k={args.top_k}"
                          + (f"; {n_cand} blocks of {B} per {args.query_tile} queries"
                             if name == "hierarchical" else "")))
        except Exception as e:  # noqa: BLE001
            rep.error(f"select/{name}/L={L}", e)
    if len(times) == 2:
        rep.row(section="select", name="speedup flat/hierarchical", L=L, time_s=None,
                speedup=round(times["flat"] / times["hierarchical"], 2))


def section_attention(rep, args, kern, L, mm_rate):
    Hq, Hkv, Dh, K = args.attn_heads, args.attn_kv_heads, args.attn_dim, args.top_k
    ka, kb, kc, kd = jax.random.split(jax.random.key(L + 1), 4)
    q = jax.random.normal(ka, (L, Hq, Dh), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kb, (L, Hkv, Dh), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kc, (L, Hkv, Dh), jnp.float32).astype(jnp.bfloat16)
    idx = random_selection(kd, L, K, L)
    selected = visible_pairs(L, K, 0)  # sum_t min(K, t + 1)
    sflops = 4.0 * Hq * Dh * selected
    dflops = 4.0 * Hq * Dh * visible_pairs(L, L, 0)

    def frac(t, fl):
        return None if not mm_rate else round(fl / t / 1e12 / mm_rate, 3)

    times = {}
    try:
        f = jax.jit(kern.sparse)
        t, first = timeit(f, q, k, v, idx, reps=args.reps)
        times["sparse"] = t
        rep.row(section="attention", name=f"sparse_attention ({kern.backend}) top_k={K}",
                L=L, time_s=t, tflops=round(sflops / t / 1e12, 1), frac_matmul=frac(t, sflops),
                first_call_s=round(first, 2))
    except Exception as e:  # noqa: BLE001
        rep.error(f"attention/sparse/L={L}", e)

    impls = ["cudnn", "xla"] if jax.default_backend() == "gpu" else [None]
    for impl in impls:
        if rep.over_budget(f"attention dense L={L}"):
            break
        if impl == "xla" and Hq * L * L * 4 > 16 << 30:
            rep.note(f"dense xla attention skipped at L={L}: [H, L, L] f32 logits > 16 GiB")
            break
        try:
            f = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q[None], k[None], v[None], is_causal=True, implementation=impl)[0])
            t, first = timeit(f, q, k, v, reps=args.reps)
            times["dense"] = t
            rep.row(section="attention", name=f"dense causal dot_product_attention ({impl})",
                    L=L, time_s=t, tflops=round(dflops / t / 1e12, 1),
                    frac_matmul=frac(t, dflops), first_call_s=round(first, 2))
            break
        except Exception as e:  # noqa: BLE001
            rep.error(f"attention/dense/{impl}/L={L}", e)
    if len(times) == 2:
        rep.row(section="attention", name="speedup dense/sparse", L=L, time_s=None,
                speedup=round(times["dense"] / times["sparse"], 2))


# --------------------------------------------------------------------------- main

def print_table(rep):
    print("\n=== summary (" + rep.data["env"].get("device_kind", "?") + ", jax "
          + rep.data["env"].get("jax", "?") + ") ===")
    for c in rep.data["correctness"]:
        print(f"  correctness {c['name']:<44} err {c['max_abs_err']:.2e} "
              f"{'OK' if c['ok'] else 'FAIL'}")
    print(f"  {'section':<10} {'L':>7}  {'name':<52} {'ms':>10} {'TFLOP/s':>8} "
          f"{'frac':>6} {'speedup':>7}")
    for r in rep.data["results"]:
        t = r.get("time_s")
        print(f"  {r['section']:<10} {r['L']:>7}  {r['name'][:52]:<52} "
              f"{'' if t is None else f'{t * 1e3:10.3f}':>10} {str(r.get('tflops', '')):>8} "
              f"{str(r.get('frac_matmul', '')):>6} {str(r.get('speedup', '')):>7}")
    for n in rep.data["notes"]:
        print(f"  note: {n}")
    for e in rep.data["errors"]:
        print(f"  ERROR {e['error'][:300]}")
    print(f"  total {rep.elapsed():.1f} s; JSON: {rep.path}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    out_dir = os.environ.get("OUT")
    path = pathlib.Path(args.out) if args.out else (
        pathlib.Path(out_dir) / "bench.json" if out_dir else pathlib.Path("results/bench.json"))
    rep = Report(path, args)
    kern = Kernels(args.backend)
    try:
        section_env(rep)
    except Exception as e:  # noqa: BLE001
        rep.error("env", e)
    mm_rate = None
    if "matmul" in args.sections:
        try:
            mm_rate = section_matmul(rep, args)
        except Exception as e:  # noqa: BLE001
            rep.error("matmul", e)
    if "correctness" in args.sections:
        section_correctness(rep, args, kern)
    if "tune" in args.sections and args.tune and args.backend == "pallas":
        try:
            section_tune(rep, args, kern)
        except Exception as e:  # noqa: BLE001
            rep.error("tune", e)
    for L in args.lengths:
        if rep.over_budget(f"L={L}"):
            break
        q = w = k = None
        if "scores" in args.sections or "select" in args.sections:
            try:
                q, w, k = section_scores(rep, args, kern, L, mm_rate) if (
                    "scores" in args.sections) else rand_inputs(
                        jax.random.key(L), L, L, args.heads, args.dim, jnp.bfloat16)
            except Exception as e:  # noqa: BLE001
                rep.error(f"scores/L={L}", e)
        if "select" in args.sections and q is not None:
            section_select(rep, args, kern, L, q, w, k)
        del q, w, k
        if "attention" in args.sections and not rep.over_budget(f"attention L={L}"):
            try:
                section_attention(rep, args, kern, L, mm_rate)
            except Exception as e:  # noqa: BLE001
                rep.error(f"attention/L={L}", e)
    rep.data["chosen_configs"] = {
        "index_scores": dataclasses.asdict(kern.index_cfg),
        "gathered_index_scores": dataclasses.asdict(kern.gather_cfg),
        "sparse_attention": dataclasses.asdict(kern.sparse_cfg)}
    rep.save()
    print_table(rep)
    return rep.data


if __name__ == "__main__":
    main()
