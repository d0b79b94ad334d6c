"""Whole-sequence top-k selection on the kernels, flat vs hierarchical, through the library.

    python -m experiments.benchmarks.kernels [--lengths 32768,65536,131072] [--out DIR]  # GPU
    python -m experiments.benchmarks.kernels --smoke [--out DIR]   # CPU: tiny, interpreter

The selection of a prefill of L tokens (queries in chunks of --chunk), on random indexer
inputs with the V3.2 indexer dims by default (64 heads x 128, top_k 2048), bf16:
  scores        pallas_kernels.index_scores over every chunk, a row max instead of a top-k
                (the scoring part of flat selection)
  flat          indexer.flat_topk (query_chunk = --chunk): scores + lax.top_k over all keys
  hierarchical  indexer.hierarchical_topk with `hierarchical_config(args)`
then the speedup flat / hierarchical and the recall of hierarchical against flat on the last
--recall-queries queries. Random inputs have no structure for the coarse stage to find, so
that recall is a floor, not the quality on a model's own inputs
(experiments.benchmarks.indexer_real measures those). Times: median of --reps calls after
a first call (compile + run, reported as first_call_s) and a warm-up call.

Hierarchical configuration: key blocks of --block (64) tokens; a tile of --query-tile (64)
queries shares one block table of cand_factor * top_k tokens (128 blocks at the defaults)
and every query of the tile ranks the whole table (share_tile_candidates); each query's own
candidate list is the sink block, its own block and the one before (local_blocks=2), then
its best blocks by coarse score (no spread blocks), cand_factor * top_k tokens in all; one
lax.map step per --chunk queries (fine_batch_size); ranking by lax.top_k.

The H200 figures committed in results/gpu/pallas_bench_h200.json (its `select` rows:
hierarchical 2.8x / 5.4x / 10.5x faster than flat at 32K / 64K / 128K) were measured by an
earlier pipeline built inside the kernel benchmark, whose tile table was the blocks with the
best coarse score over the tile's queries; a rerun of this script measures the library's
hierarchical_topk instead (tile table = the union of its queries' own lists).

Writes OUT/bench_kernels.json (--out, default runs/bench_kernels/). Kernel-level numbers
(each kernel against its reference, TFLOP/s) come from `python -m pallas_kernels.bench`.
"""

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
from jax import lax

import indexer
import pallas_kernels
from experiments.common import (
    add_out_argument,
    block,
    enable_compile_cache,
    machine_description,
    time_call,
    write_json,
)
from indexer import HierarchicalConfig

NAME = "bench_kernels"
GPU_DEFAULTS = dict(lengths="32768,65536,131072", heads=64, dim=128, top_k=2048, chunk=4096,
                    block=64, query_tile=64, cand_factor=4, reps=5, recall_queries=1024,
                    budget=600.0)
SMOKE_DEFAULTS = dict(lengths="256", heads=4, dim=32, top_k=32, chunk=128, block=16,
                      query_tile=16, cand_factor=4, reps=2, recall_queries=64, budget=300.0)


def hierarchical_config(args):
    """The HierarchicalConfig timed here (see the module docstring)."""
    budget = args.cand_factor * args.top_k
    return HierarchicalConfig(
        block_size=args.block, candidate_tokens=budget, tile_candidate_tokens=budget,
        share_tile_candidates=True, query_tile=args.query_tile, fine_batch_size=args.chunk,
        sink_blocks=1, local_blocks=2, bound_blocks=0, fast_ranking=False)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.benchmarks.kernels",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, kernels in interpret mode (tests; no performance figures)")
    p.add_argument("--backend", choices=sorted(pallas_kernels.OPS["index_scores"].implementations),
                   default=None,
                   help="kernel backend (default: pallas on GPU unless --smoke, else interpret)")
    for flag, kind, what in [
            ("lengths", str, "comma-separated sequence lengths (multiples of --chunk)"),
            ("heads", int, "indexer heads"), ("dim", int, "indexer head dim"),
            ("top-k", int, "selected tokens per query"), ("chunk", int, "query chunk"),
            ("block", int, "key block size"), ("query-tile", int, "queries per block table"),
            ("cand-factor", int, "candidate tokens = cand_factor * top_k"),
            ("reps", int, "timed calls (median reported)"),
            ("recall-queries", int, "last queries on which recall is measured"),
            ("budget", float, "seconds; later measurements are skipped after")]:
        p.add_argument(f"--{flag}", type=kind, help=what)
    add_out_argument(p, NAME)
    args = p.parse_args(argv)
    for name, value in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    if any(L % min(args.chunk, L) for L in args.lengths):
        p.error(f"--lengths {args.lengths} must be multiples of --chunk {args.chunk}")
    if args.backend is None:
        on_gpu = jax.default_backend() == "gpu"
        args.backend = "pallas" if on_gpu and not args.smoke else "interpret"
    try:
        hierarchical_config(args)
    except ValueError as e:
        p.error(str(e))
    return args


def random_inputs(L, H, D, seed=0):
    """q bf16[L, H, D], w f32[L, H] (scaled so scores stay O(1)), k bf16[L, D]."""
    kq, kw, kk = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (L, H, D), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (L, H), jnp.float32) * (H * D) ** -0.5
    k = jax.random.normal(kk, (L, D), jnp.float32).astype(jnp.bfloat16)
    return q, w, k


def pipelines(args, config):
    """{name: jitted f(q, w, k)} for the whole sequence, in the order they are timed."""
    backend = args.backend

    @jax.jit
    def scores(q, w, k):
        chunk = min(args.chunk, q.shape[0])
        n = q.shape[0] // chunk

        def one(a):
            qc, wc, off = a
            s = pallas_kernels.index_scores(qc, wc, k, q_offset=off, backend=backend)
            return jnp.max(s, axis=1)  # keeps the scores live without a top-k

        return lax.map(one, (q.reshape(n, chunk, *q.shape[1:]), w.reshape(n, chunk, -1),
                             chunk * jnp.arange(n, dtype=jnp.int32)))

    return {
        "scores": scores,
        "flat": lambda q, w, k: indexer.flat_topk(q, w, k, args.top_k, query_chunk=args.chunk,
                                                  backend=backend),
        "hierarchical": lambda q, w, k: indexer.hierarchical_topk(q, w, k, args.top_k, config,
                                                                  backend=backend),
    }


def bench_length(result, args, config, L, t0):
    """Times every pipeline at length L; appends rows (and errors) to result."""
    q, w, k = random_inputs(L, args.heads, args.dim, seed=L)
    times, outputs = {}, {}
    for name, fn in pipelines(args, config).items():
        if time.perf_counter() - t0 > args.budget:
            result["notes"].append(f"skipped {name} at L={L}: past the {args.budget:.0f} s budget")
            continue
        try:
            start = time.perf_counter()
            outputs[name] = block(fn(q, w, k))
            first = time.perf_counter() - start
            times[name] = time_call(lambda fn=fn: fn(q, w, k), repeats=args.reps, warmup=1)
        except Exception as e:  # noqa: BLE001 - report and go on with the other pipelines
            result["errors"].append({"pipeline": name, "L": L,
                                     "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"[ERROR] {name} L={L}: {type(e).__name__}: {e}", flush=True)
            continue
        result["rows"].append({"pipeline": name, "L": L, "time_s": times[name],
                               "first_call_s": round(first, 3)})
        print(f"{L:>8} {name:<13} {times[name] * 1e3:10.3f} ms  (first call {first:.2f} s)",
              flush=True)
    row = {"pipeline": "flat vs hierarchical", "L": L}
    if "flat" in times and "hierarchical" in times:
        row["speedup"] = round(times["flat"] / times["hierarchical"], 3)
    if "flat" in outputs and "hierarchical" in outputs:
        n = min(args.recall_queries, L)
        row["recall"] = round(indexer.recall(outputs["hierarchical"][-n:],
                                             outputs["flat"][-n:]), 4)
        row["recall_queries"] = n
    if len(row) > 2:
        result["rows"].append(row)
        print(f"{L:>8} flat/hierarchical speedup {row.get('speedup')}, recall "
              f"{row.get('recall')} on the last {row.get('recall_queries')} queries", flush=True)


def main(argv=None):
    """Runs the benchmark -> the result dict (also written to OUT/bench_kernels.json)."""
    args = parse_args(argv)
    enable_compile_cache()
    platform = jax.default_backend()
    config = hierarchical_config(args)
    result = {"smoke": args.smoke, "backend": args.backend,
              "args": {k: v for k, v in vars(args).items() if k != "out"},
              "machine": machine_description(), "hierarchical_config": config.to_dict(),
              "rows": [], "errors": [], "notes": []}
    if args.smoke or args.backend == "interpret" or platform != "gpu":
        what = "SMOKE RUN: tiny shapes, " if args.smoke else "NOTE: "
        message = (f"{what}{args.backend} kernels on {platform}: checks that the benchmark "
                   "runs; its timings are NOT performance figures.")
        print(message, flush=True)
        result["notes"].append(message)
    print(f"selection of L tokens in chunks of {args.chunk}, top_k={args.top_k}, H_I="
          f"{args.heads}, d_I={args.dim}, backend={args.backend} on {machine_description()}")
    path = pathlib.Path(args.out) / f"{NAME}.json"
    t0 = time.perf_counter()
    for L in args.lengths:
        bench_length(result, args, config, L, t0)
        write_json(path, result)
    print(f"wrote {write_json(path, result)}")
    return result


if __name__ == "__main__":
    main()
