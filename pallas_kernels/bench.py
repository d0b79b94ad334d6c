"""Kernel microbenchmark: each Pallas kernel against its jnp reference, for correctness and
for speed, with a bf16 matmul measured in the same run as the yardstick.

    python -m pallas_kernels.bench [--lengths 32768,65536] [--no-tune] [--out DIR]   # GPU
    python -m pallas_kernels.bench --smoke [--out DIR]   # CPU: tiny shapes, interpreter

Kernels: index_scores (V3.2 indexer dims by default: 64 heads x 128), gathered_index_scores
(query tiles against candidate key blocks read through a block table) and sparse_attention
(top_k selected tokens per query, shared by every head).

Sections, each wrapped so that one failure still lets the others report:
  env          jax version, backend, device kind
  matmul       bf16 [n, n] x [n, n] jnp.dot rate: the yardstick of every frac_matmul column
  correctness  every kernel vs its reference on fresh random inputs (a new seed per run,
               recorded in the JSON; --seed repeats a run) at lengths that are not tile
               multiples, outputs poisoned (NaN) before the call so an unwritten tile shows;
               also the public dispatch (pallas_kernels.index_scores) under jit + vmap with
               a traced q_offset
  tune         a few tile configurations per kernel at the shortest length; the fastest is
               used below (GPU only; --no-tune keeps the defaults)
  scores       index_scores on the last query chunk (the costliest: it sees every key), and
               over the whole causal sequence in chunks (the skipped upper tiles show)
  gathered     gathered_index_scores on the last chunk: per tile of query_tile queries,
               cand_factor * top_k / block visible key blocks
  attention    sparse_attention, top_k random earlier tokens per query, whole sequence;
               dense causal jax.nn.dot_product_attention (cuDNN on GPU) for scale
Each kernel row has a reference row (`speedup` = reference time / kernel time). A reference
materialises [T, heads, keys] f32, so it is timed on the last queries that fit in
--ref-slice-bytes and scaled by the query count (its work is linear in it, causal or not);
the row's note says so.

The report (pallas_bench.json) goes to --out (default runs/pallas_bench/); a table is
printed last. Every section checks a deadline (--budget seconds) and skips what would not
fit. Selection pipelines (flat vs hierarchical top-k) are benchmarked by
`python -m experiments.benchmarks.kernels`, which uses indexer/. Figures of record (one
H200): results/gpu/pallas_bench_h200.json, written by an earlier version of this script.
"""

import argparse
import dataclasses
import functools
import pathlib
import secrets

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels
from pallas_kernels.bench_common import (
    Report,
    env_info,
    gathered_case,
    normal,
    rand_inputs,
    scores_case,
    sparse_case,
    tflops,
    timeit,
    visible_pairs,
)
from pallas_kernels.bench_grouped import section_grouped_correctness
from pallas_kernels.gathered_index_scores import GatheredScoresConfig
from pallas_kernels.index_scores import (
    IndexScoresConfig,
    index_scores_pallas,
    index_scores_reference,
)
from pallas_kernels.sparse_attention import SparseAttentionConfig

__all__ = ["main", "visible_pairs"]

DEFAULT_OUT = pathlib.Path("runs") / "pallas_bench"
SECTIONS = ("matmul", "correctness", "tune", "scores", "gathered", "attention")
SMOKE_BANNER = ("SMOKE RUN: tiny shapes, Pallas kernels in {backend} mode on {platform}. It "
                "checks that the benchmark works; its timings are NOT performance figures.")

GPU_DEFAULTS = dict(lengths="32768,65536,131072", heads=64, dim=128, top_k=2048, chunk=4096,
                    block=64, query_tile=64, cand_factor=4, attn_heads=16, attn_kv_heads=1,
                    attn_dim=128, matmul_n=8192, reps=10, budget=330.0,
                    ref_slice_bytes=4 << 30, correctness_len=4096)
SMOKE_DEFAULTS = dict(lengths="256", heads=4, dim=32, top_k=32, chunk=128, block=16,
                      query_tile=16, cand_factor=4, attn_heads=4, attn_kv_heads=1, attn_dim=32,
                      matmul_n=256, reps=2, budget=120.0, ref_slice_bytes=1 << 20,
                      correctness_len=200)

# Configurations tried by the tune section (the first of each list is the file's default).
TUNE = {
    "index_scores": [IndexScoresConfig(64, 128, 4, 2), IndexScoresConfig(64, 128, 4, 3),
                     IndexScoresConfig(64, 128, 8, 2), IndexScoresConfig(128, 128, 8, 2),
                     IndexScoresConfig(64, 64, 4, 2)],
    "gathered_index_scores": [GatheredScoresConfig(64, 128, 8, 3),
                              GatheredScoresConfig(64, 128, 4, 2),
                              GatheredScoresConfig(64, 128, 8, 2),
                              GatheredScoresConfig(128, 128, 8, 3)],
    "sparse_attention": [SparseAttentionConfig(128, 64, 8, 2), SparseAttentionConfig(64, 64, 4, 3),
                         SparseAttentionConfig(64, 64, 4, 2),
                         SparseAttentionConfig(128, 64, 8, 2, skip_empty_chunks=True)],
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU, Pallas interpreter (tests; no performance figures)")
    p.add_argument("--backend", choices=("pallas", "interpret"), default=None,
                   help="default: pallas on GPU unless --smoke, else interpret")
    for flag, kind, what in [
            ("lengths", str, "comma-separated sequence lengths"), ("heads", int, "indexer heads"),
            ("dim", int, "indexer head dim"), ("top-k", int, "selected tokens per query"),
            ("chunk", int, "query chunk (prefill)"), ("block", int, "key block size"),
            ("query-tile", int, "queries sharing one block table"),
            ("cand-factor", int, "block table tokens = cand_factor * top_k"),
            ("attn-heads", int, "query heads"), ("attn-kv-heads", int, "kv heads"),
            ("attn-dim", int, "attention head dim"), ("matmul-n", int, "yardstick size"),
            ("reps", int, "timed repetitions (median reported)"),
            ("budget", float, "seconds; later sections are skipped after"),
            ("ref-slice-bytes", int, "memory a timed reference call may materialise"),
            ("correctness-len", int, "keys in the correctness cases (+37)")]:
        p.add_argument(f"--{flag}", type=kind, help=what)
    p.add_argument("--sections", default=",".join(SECTIONS), help="subset of " + ",".join(SECTIONS))
    p.add_argument("--no-tune", dest="tune", action="store_false")
    p.add_argument("--seed", type=int, help="correctness inputs (default: a fresh one per run)")
    p.add_argument("--out", help=f"output directory (default {DEFAULT_OUT}/)")
    args = p.parse_args(argv)
    for name, value in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    args.sections = set(args.sections.split(","))
    if args.sections - set(SECTIONS):
        p.error(f"unknown sections {sorted(args.sections - set(SECTIONS))}")
    if args.backend is None:
        on_gpu = jax.default_backend() == "gpu"
        args.backend = "pallas" if on_gpu and not args.smoke else "interpret"
    args.tune = args.tune and args.backend == "pallas"
    if args.seed is None:
        args.seed = secrets.randbits(31)
    return args


def section_matmul(rep, args, chain=8):
    """bf16 [n, n] @ [n, n] rate: `chain` dependent jnp.dot calls in one jit, so the
    per-call dispatch and sync (which the kernel timings also carry, once per call) do
    not dilute the yardstick. b is scaled by n^-1/2 so the chain stays O(1) (no inf)."""
    n = args.matmul_n
    ka, kb = jax.random.split(jax.random.key(7))
    a = normal(ka, (n, n), jnp.bfloat16)
    b = (jax.random.normal(kb, (n, n), jnp.float32) * n**-0.5).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: lax.fori_loop(0, chain, lambda i, x: jnp.dot(x, b), a))
    t, _ = timeit(f, a, b, reps=max(args.reps, 10))
    rate = chain * 2 * n**3 / t / 1e12
    rep.data["env"]["matmul_tflops"] = rate
    rep.row(section="matmul", name=f"bf16 jnp.dot {n}^3 (x{chain} chained)", L=n,
            time_s=t / chain, tflops=tflops(chain * 2 * n**3, t))
    return rate


def section_correctness(rep, args, configs):
    """Every kernel (poisoned output) against its reference; then the public dispatch."""
    L, B, qt = args.correctness_len, args.block, args.query_tile
    T = max(qt, min(1024, L // 2) // qt * qt)
    ks = jax.random.split(jax.random.key(args.seed), 8)
    interpret = args.backend == "interpret"
    Lk = L + 37
    cases = [  # (name, case, rtol): f32 outputs differ by summation order only; bf16 by ulps
        ("index_scores bf16 last chunk", lambda: scores_case(ks[0], T, Lk, args), 1e-3),
        ("index_scores f32 q_offset=0",
         lambda: scores_case(ks[1], T, T + 5, args, dtype=jnp.float32, q_offset=0), 1e-3),
        ("index_scores coarse (key_block_size=B)",
         lambda: scores_case(ks[2], T, Lk // B + 1, args, q_offset=Lk - T, key_block_size=B),
         1e-3),
        ("gathered_index_scores bf16",
         lambda: gathered_case(ks[3], T, Lk, args, visible_only=False), 1e-3),
    ]
    for i, (Hq, Hkv) in enumerate([(args.attn_heads, args.attn_kv_heads), (8, 2)]):
        cases.append((f"sparse_attention bf16 H={Hq} H_kv={Hkv}", functools.partial(
            sparse_case, ks[4 + i], min(T, 512), L, args, heads=Hq, kv_heads=Hkv), 1.6e-2))
    for name, make, rtol in cases:
        try:
            case = make()
            if case.kernel == "sparse_attention":  # one query with nothing selected: zeros
                case = dataclasses.replace(case, arrays=(
                    *case.arrays[:3], case.arrays[3].at[3].set(-1)))
            out = case.pallas(*case.arrays, config=configs[case.kernel], interpret=interpret,
                              poison=float("nan"))
            rep.check(name, out, jax.jit(case.reference)(*case.arrays), rtol)
        except Exception as e:  # noqa: BLE001 - report and go on
            rep.error(f"correctness/{name}", e)
    try:
        # Through the public dispatch, jitted with a traced q_offset and vmapped over two
        # sequences, as indexer/ and model/ call it.
        Ta, La = T // 2, L // 2
        q, w, k = rand_inputs(ks[7], 2 * Ta, La, args.heads, args.dim, jnp.bfloat16)
        qs, ws = q.reshape(2, Ta, *q.shape[1:]), w.reshape(2, Ta, w.shape[1])
        kk, offs = jnp.stack([k, k[::-1]]), jnp.array([La - Ta, La // 3], jnp.int32)
        f = jax.jit(jax.vmap(lambda q, w, k, o: pallas_kernels.index_scores(
            q, w, k, q_offset=o, backend=args.backend)))
        ref = jnp.stack([index_scores_reference(qs[i], ws[i], kk[i], q_offset=offs[i])
                         for i in range(2)])
        rep.check("api index_scores jit+vmap, traced q_offset", f(qs, ws, kk, offs), ref, 1e-3)
    except Exception as e:  # noqa: BLE001
        rep.error("correctness/api", e)
    section_grouped_correctness(rep, args, ks[6])


def section_tune(rep, args, configs):
    """The fastest configuration of each kernel on the last chunk at the shortest length."""
    L = min(args.lengths)
    Tc = min(args.chunk, L)
    for i, make in enumerate([scores_case, gathered_case, sparse_case]):
        case = make(jax.random.key(11 + i), Tc, L, args)
        best = None
        for cfg in TUNE[case.kernel]:
            if rep.over_budget(f"tune {case.kernel} {cfg}"):
                break
            try:
                f = case.jitted(cfg, interpret=False)
                if best is None:  # the first config measured slow without more warm-up
                    for _ in range(3):
                        jax.block_until_ready(f(*case.arrays))
                t, first = timeit(f, *case.arrays, reps=5, target_s=0.5)
            except Exception as e:  # noqa: BLE001
                rep.error(f"tune/{case.kernel}/{cfg}", e)
                continue
            rate = tflops(case.flops, t)
            rep.data["tuning"].append(dict(kernel=case.kernel, config=dataclasses.asdict(cfg),
                                           time_s=t, tflops=rate, first_call_s=first))
            print(f"[tune] {case.kernel} {cfg}: {t * 1e3:.3f} ms, {rate:.1f} TFLOP/s", flush=True)
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is not None:
            configs[case.kernel] = best[1]
    rep.data["tuned"] = {k: dataclasses.asdict(v) for k, v in configs.items()}
    print(f"[tune] chosen: {rep.data['tuned']}", flush=True)


def frac(flops, t, mm_rate):
    return None if not mm_rate else round(flops / t / 1e12 / mm_rate, 3)


def time_against_reference(rep, args, section, label, make, T, L, config, mm_rate):
    """Rows for the kernel on make(key, T, L, args) and for its reference (on the last rows
    that fit in --ref-slice-bytes, scaled) -> the kernel's time, or None."""
    t_kernel = None
    try:
        case = make(jax.random.key(L), T, L, args)
        t, first = timeit(case.jitted(config, args.backend == "interpret"), *case.arrays,
                          reps=args.reps)
        t_kernel = t
        rep.row(section=section, name=f"{case.kernel} ({args.backend}) {label}", L=L, time_s=t,
                tflops=tflops(case.flops, t), frac_matmul=frac(case.flops, t, mm_rate),
                first_call_s=round(first, 2))
        del case
    except Exception as e:  # noqa: BLE001
        rep.error(f"{section}/kernel/L={L}", e)
    if rep.over_budget(f"{section} reference L={L}"):
        return t_kernel
    try:
        qt = args.query_tile
        probe = make(jax.random.key(L + 1), qt, L, args)
        Ts = max(qt, min(T, args.ref_slice_bytes // probe.ref_bytes_per_query) // qt * qt)
        case = make(jax.random.key(L + 1), Ts, L, args) if Ts != qt else probe
        t, _ = timeit(jax.jit(case.reference), *case.arrays, reps=args.reps)
        scaled = t * T / Ts
        flops = case.flops * T / Ts
        rep.row(section=section, name=f"{case.kernel} reference (xla) {label}", L=L,
                time_s=scaled, tflops=tflops(flops, scaled),
                frac_matmul=frac(flops, scaled, mm_rate),
                speedup=None if t_kernel is None else round(scaled / t_kernel, 2),
                note=None if Ts == T else
                f"timed on the last {Ts} queries ({t * 1e3:.3f} ms), scaled x{T / Ts:g}")
    except Exception as e:  # noqa: BLE001
        rep.error(f"{section}/reference/L={L}", e)
    return t_kernel


def whole_sequence_scores(rep, args, L, config, mm_rate):
    """index_scores of every query of an L-token sequence, in chunks (a row max per chunk
    keeps the scores live)."""
    Tc = min(args.chunk, L)
    n = L // Tc
    q, w, k = rand_inputs(jax.random.key(L + 2), n * Tc, L, args.heads, args.dim, jnp.bfloat16)
    interpret = args.backend == "interpret"

    def run(q, w, k):
        def one(a):
            s = index_scores_pallas(a[0], a[1], k, a[2], config=config, interpret=interpret)
            return jnp.max(s, axis=1)
        return lax.map(one, (q.reshape(n, Tc, *q.shape[1:]), w.reshape(n, Tc, w.shape[1]),
                             Tc * jnp.arange(n, dtype=jnp.int32)))

    t, first = timeit(jax.jit(run), q, w, k, reps=args.reps)
    flops = 2.0 * args.heads * args.dim * visible_pairs(n * Tc, L, 0)
    rep.row(section="scores", name=f"index_scores ({args.backend}) whole causal sequence", L=L,
            time_s=t, tflops=tflops(flops, t), frac_matmul=frac(flops, t, mm_rate),
            first_call_s=round(first, 2), note=f"{n} chunks of {Tc}; + a row max per chunk")


def dense_attention(rep, args, L, t_sparse, mm_rate):
    """Dense causal attention of the same shapes (cuDNN on GPU, XLA otherwise)."""
    kq, kk, kv = jax.random.split(jax.random.key(L + 3), 3)
    Hq, Hkv, Dh = args.attn_heads, args.attn_kv_heads, args.attn_dim
    q = normal(kq, (L, Hq, Dh), jnp.bfloat16)
    k, v = normal(kk, (L, Hkv, Dh), jnp.bfloat16), normal(kv, (L, Hkv, Dh), jnp.bfloat16)
    flops = 4.0 * q.shape[1] * q.shape[2] * visible_pairs(L, L, 0)
    for impl in (["cudnn", "xla"] if jax.default_backend() == "gpu" else [None]):
        if impl == "xla" and q.shape[1] * L * L * 4 > 16 << 30:
            rep.note(f"dense xla attention skipped at L={L}: [H, L, L] f32 logits > 16 GiB")
            return
        try:
            f = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q[None], k[None], v[None], is_causal=True, implementation=impl)[0])
            t, first = timeit(f, q, k, v, reps=args.reps)
            rep.row(section="attention", name=f"dense causal dot_product_attention ({impl})",
                    L=L, time_s=t, tflops=tflops(flops, t),
                    frac_matmul=frac(flops, t, mm_rate), first_call_s=round(first, 2),
                    speedup=None if t_sparse is None else round(t / t_sparse, 2))
            return
        except Exception as e:  # noqa: BLE001
            rep.error(f"attention/dense/{impl}/L={L}", e)


def print_table(rep):
    env = rep.data["env"]
    print(f"\n=== summary ({env.get('device_kind', '?')}, jax {env.get('jax', '?')}) ===")
    for c in rep.data["correctness"]:
        print(f"  correctness {c['name']:<44} err {c['max_abs_err']:.2e} "
              f"{'OK' if c['ok'] else 'FAIL'}")
    print(f"  {'section':<10} {'L':>7}  {'name':<56} {'ms':>10} {'TFLOP/s':>8} "
          f"{'frac':>6} {'speedup':>7}")
    for r in rep.data["results"]:
        t = r.get("time_s")
        print(f"  {r['section']:<10} {r['L']:>7}  {r['name'][:56]:<56} "
              f"{'' if t is None else f'{t * 1e3:10.3f}':>10} {str(r.get('tflops', '')):>8} "
              f"{str(r.get('frac_matmul') or ''):>6} {str(r.get('speedup') or ''):>7}")
    for n in rep.data["notes"]:
        print(f"  note: {n}")
    for e in rep.data["errors"]:
        print(f"  ERROR {e['error'][:300]}")
    print(f"  total {rep.elapsed():.1f} s; JSON: {rep.path}", flush=True)


def main(argv=None):
    """Runs the sections chosen by argv -> the report data (written to pallas_bench.json)."""
    args = parse_args(argv)
    rep = Report(pathlib.Path(args.out or DEFAULT_OUT) / "pallas_bench.json", args)
    platform = jax.default_backend()
    if args.smoke or args.backend == "interpret" or platform != "gpu":
        print(SMOKE_BANNER.format(backend=args.backend, platform=platform) if args.smoke else
              f"NOTE: {args.backend} kernels on {platform}: the timings below are NOT "
              "performance figures.", flush=True)
        rep.note(f"not performance figures: {'smoke run, tiny shapes, ' * args.smoke}"
                 f"{args.backend} kernels on {platform}")
    rep.data["env"] = env_info()
    print(f"[env] {rep.data['env']}; correctness seed {args.seed}", flush=True)
    configs = {kernel: tries[0] for kernel, tries in TUNE.items()}
    mm_rate = None
    if "matmul" in args.sections:
        try:
            mm_rate = section_matmul(rep, args)
        except Exception as e:  # noqa: BLE001
            rep.error("matmul", e)
    if "correctness" in args.sections:
        section_correctness(rep, args, configs)
    if "tune" in args.sections and args.tune:
        section_tune(rep, args, configs)
    for L in args.lengths:
        Tc = min(args.chunk, L)
        if "scores" in args.sections and not rep.over_budget(f"scores L={L}"):
            time_against_reference(rep, args, "scores", f"last {Tc} queries", scores_case,
                                   Tc, L, configs["index_scores"], mm_rate)
            if not rep.over_budget(f"scores whole sequence L={L}"):
                try:
                    whole_sequence_scores(rep, args, L, configs["index_scores"], mm_rate)
                except Exception as e:  # noqa: BLE001
                    rep.error(f"scores/whole/L={L}", e)
        if "gathered" in args.sections and not rep.over_budget(f"gathered L={L}"):
            time_against_reference(rep, args, "gathered", f"last {Tc} queries", gathered_case,
                                   Tc, L, configs["gathered_index_scores"], mm_rate)
        if "attention" in args.sections and not rep.over_budget(f"attention L={L}"):
            t_sparse = time_against_reference(
                rep, args, "attention", f"top_k={args.top_k} whole sequence", sparse_case, L, L,
                configs["sparse_attention"], mm_rate)
            if not rep.over_budget(f"attention dense L={L}"):
                dense_attention(rep, args, L, t_sparse, mm_rate)
    rep.data["chosen_configs"] = {k: dataclasses.asdict(v) for k, v in configs.items()}
    rep.save()
    print_table(rep)
    return rep.data


if __name__ == "__main__":
    main()
