"""Indexer time, flat vs hierarchical, side by side in one run; recall and IoU against flat.

    python -m experiments.benchmarks.indexer [--lengths 8192,16384,32768,65536] [--queries 2048]
    python -m experiments.benchmarks.indexer --smoke          # tiny sizes, seconds (CI)
    python -m experiments.benchmarks.indexer --real-lengths 16384,32768 --real-queries 1024

Indexer dims of the `small` preset (H_I=4, d_I=64, top_k=256) and its hierarchical config.
For each context length L both methods select for the same slice of queries: the last
`--queries` positions of the sequence (they see the whole context). Both methods cost the
same per query wherever it sits (static shapes: flat scores all L keys then masks,
hierarchical scores all L / B blocks), so the ratio on the slice is the ratio of a full
prefill; the slice keeps the flat baseline at 64K within minutes on 2 CPU cores.
Times are medians of --repeats interleaved runs after a warm-up (compile excluded),
block_until_ready included. Flat runs with query_chunk=--flat-chunk (128: its fastest on
2 CPU cores, ~1.4x faster than its default 512), so the baseline is not handicapped.

Inputs (seeded):
- random: q, w, k i.i.d. standard normal (no structure: block selection cannot beat chance);
- structured: keys with locality, k_s = 0.99 c_seg(s) + 0.14 noise, where segments have
  random lengths in [32, 96] and their centres c follow a random walk (step 0.5); queries
  and head weights drift slowly from token to token (random walks plus per-token noise);
  plus 4 "needle" keys in the first half of the context aligned with a direction every
  query carries, so they are in the top_k of most queries while their blocks' means hide
  them.
- real: the trained model's own indexer inputs on held-out text, every layer, at
  --real-lengths, with the block-recall ceiling (experiments.benchmarks.indexer_real).
Also: exact mode (equals flat) on the structured inputs with the fraction of blocks it
rescored; the FLOP ratio (ideal speedup) and the fraction of it achieved; one decode step
at --decode-length (one query against cached block summaries, summary append included, vs
flat over all keys). Prints a Markdown table, writes OUT/bench_indexer.json (--out, default
runs/bench_indexer/).
"""

import argparse
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import indexer
from experiments.benchmarks.indexer_real import bench_real, markdown_real
from experiments.benchmarks.support import (
    equal_up_to_ties,
    jit_block_summaries,
    median_interleaved,
    random_inputs,
    structured_inputs,
)
from experiments.common import (
    add_out_argument,
    enable_compile_cache,
    machine_description,
    parse_layers,
    write_json,
)
from indexer import HierarchicalConfig
from indexer.block_summaries import append, block_summaries
from model import get_config


def flops_per_query(L, H, d, config, top_k):
    """Multiply-adds x 2 per query: flat scores every key; hierarchical scores every block
    mean (coarse heads), then its tile's table of candidate tokens."""
    flat = 2 * H * d * L
    nb = -(-L // config.block_size)
    hc = config.coarse_heads or H
    n_cand = min(nb, config.candidate_blocks(nb))
    n_union = n_cand
    if config.query_tile > 1:
        tile_tokens = config.tile_candidate_tokens or 2 * n_cand * config.block_size
        n_union = min(nb, max(n_cand, -(-tile_tokens // config.block_size)))
    hier = 2 * hc * d * nb + 2 * H * d * n_union * config.block_size
    if config.exact:
        hier += 6 * H * d * nb  # upper bounds: min/max (2 d) and centre (d) products per head
    return flat, hier


def _selection_fns(q, w, k, top_k, config, q_offset, flat_chunk):
    """Both methods on the same queries. The block summaries are built once per context
    (as the model's cache does while keys are written) and timed on their own: per query
    of a full prefill they cost 1 / L of the slice's share."""
    exact_config = config.replace(exact=True)
    summaries = jax.block_until_ready(jit_block_summaries(k, block_size=config.block_size))
    fns = {
        "flat": lambda: indexer.flat_topk(q, w, k, top_k, q_offset=q_offset,
                                          query_chunk=flat_chunk),
        "hierarchical": lambda: indexer.hierarchical_topk(q, w, k, top_k, config,
                                                          q_offset=q_offset, summaries=summaries),
        "exact": lambda: indexer.hierarchical_topk_with_stats(
            q, w, k, top_k, exact_config, q_offset=q_offset, summaries=summaries),
        "summaries": lambda: jit_block_summaries(k, block_size=config.block_size),
    }
    return fns, exact_config


def bench_length(L, args, H, d, top_k, config):
    n = min(args.queries, L)
    q_offset = L - n
    row = {"length": L, "queries": n, "q_offset": q_offset}
    # "unaligned": the same structure with segments of 32-96 tokens that straddle blocks, so
    # the figures do not depend on segments matching the block size.
    unaligned = functools.partial(structured_inputs, aligned=False)
    for kind, make in (("random", random_inputs), ("structured", structured_inputs),
                       ("unaligned", unaligned)):
        q, w, k, needles = (jnp.asarray(a) for a in make(args.seed + L, L, n, H, d))
        fns, exact_config = _selection_fns(q, w, k, top_k, config, q_offset, args.flat_chunk)
        if kind == "random" and not args.exact_on_random:
            del fns["exact"]  # bounds prune nothing without structure: exact ~ flat + bounds
        outs = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}  # warm-up
        times = median_interleaved(fns, args.repeats)
        flat = np.asarray(outs["flat"])
        hier = np.asarray(outs["hierarchical"])
        res = {
            "flat_s": times["flat"], "hierarchical_s": times["hierarchical"],
            "summaries_s": times["summaries"],
            "speedup": times["flat"] / times["hierarchical"],
            "recall": indexer.recall(hier, flat), "iou": indexer.iou(hier, flat),
        }
        if len(needles):
            needles = np.asarray(needles)
            res["needles_in_flat"] = float(np.mean([np.isin(needles, r).sum() for r in flat]))
            res["needles_in_hierarchical"] = float(np.mean([np.isin(needles, r).sum()
                                                            for r in hier]))
        if "exact" in outs:
            exact, stats = outs["exact"]
            exact = np.asarray(exact)
            res.update({
                "exact_s": times["exact"], "exact_speedup": times["flat"] / times["exact"],
                "exact_recall": indexer.recall(exact, flat),
                "exact_equals_flat": equal_up_to_ties(q, w, k, exact, flat),
                "exact_scored_fraction": float(stats["scored_fraction"]),
                "exact_rescored_fraction": float(stats["rescored_fraction"]),
                "exact_rounds": int(stats["rounds"]),
            })
        row[kind] = res
    flat_flops, hier_flops = flops_per_query(L, H, d, config, top_k)
    row["flop_ratio"] = flat_flops / hier_flops
    row["fraction_of_flop_ratio"] = row["structured"]["speedup"] / row["flop_ratio"]
    return row


def bench_decode(L, args, H, d, top_k, config):
    """One decode step at position L - 1: flat over L keys vs hierarchical from cached
    summaries (the new key's summary append included)."""
    q, w, k, _ = (jnp.asarray(a) for a in structured_inputs(args.seed, L, 1, H, d))
    B = config.block_size
    before = block_summaries(k, B, length=L - 1)  # the cache before this token
    flat = jax.jit(lambda q, w, k: indexer.flat_topk(q, w, k, top_k, q_offset=L - 1))

    @jax.jit
    def hier(q, w, k, summaries):
        summaries = append(summaries, k[L - 1:], L - 1, block_size=B, keys=k)
        return indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=L - 1,
                                         summaries=summaries)

    fns = {"flat": lambda: flat(q, w, k), "hierarchical": lambda: hier(q, w, k, before)}
    outs = {name: np.asarray(jax.block_until_ready(fn())) for name, fn in fns.items()}
    times = median_interleaved(fns, args.decode_repeats)
    return {"length": L, "flat_s": times["flat"], "hierarchical_s": times["hierarchical"],
            "speedup": times["flat"] / times["hierarchical"],
            "recall": indexer.recall(outs["hierarchical"], outs["flat"])}


def markdown(result):
    c = result["setup"]
    lines = [
        f"Indexer selection, H_I={c['H']}, d_I={c['d']}, top_k={c['top_k']}, last "
        f"{c['queries']} queries of each context (they see all of it); median of "
        f"{c['repeats']} interleaved runs; flat query_chunk={c['flat_query_chunk']}; "
        f"{c['machine']['device_kind']} "
        f"({c['machine']['cpu_count']} CPUs), jax {c['machine']['jax']}.",
        f"hierarchical: {c['hierarchical']}",
        "",
        "| L | input | flat s | hier s | speedup | FLOP ratio | of ideal | recall | IoU "
        "| exact s | exact speedup | exact = flat | rescored |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["lengths"]:
        for kind in ("random", "structured", "unaligned"):
            r = row[kind]
            exact = (f"{r['exact_s']:.3f} | {r['exact_speedup']:.2f}x | "
                     f"{'yes' if r['exact_equals_flat'] else 'NO'} | "
                     f"{r['exact_rescored_fraction']:.1%}") if "exact_s" in r else "- | - | - | -"
            lines.append(
                f"| {row['length']} | {kind} | {r['flat_s']:.3f} | {r['hierarchical_s']:.3f} | "
                f"{r['speedup']:.2f}x | {row['flop_ratio']:.1f}x | "
                f"{r['speedup'] / row['flop_ratio']:.0%} | {r['recall']:.4f} | {r['iou']:.4f} "
                f"| {exact} |")
    if result.get("decode"):
        dec = result["decode"]
        lines += ["", f"Decode step at L={dec['length']} (one query; hierarchical reads cached "
                  f"block summaries, append included): flat {dec['flat_s'] * 1e3:.2f} ms, "
                  f"hierarchical {dec['hierarchical_s'] * 1e3:.2f} ms "
                  f"({dec['speedup']:.1f}x), recall {dec['recall']:.4f}."]
    lines += ["", "Block summaries of a whole context (built once, O(L d_I); the model's cache "
              "extends them as keys are written; not in 'hier s'): " + ", ".join(
                  f"{row['length']}: {row['structured']['summaries_s'] * 1e3:.1f} ms"
                  for row in result["lengths"])]
    needles = [(row["length"], row["structured"]) for row in result["lengths"]]
    lines += ["", "Needles (structured) in top_k per query, flat / hierarchical: " + ", ".join(
        f"{L}: {r['needles_in_flat']:.2f} / {r['needles_in_hierarchical']:.2f}"
        for L, r in needles)]
    return "\n".join(lines)


def real_model_rows(args, config):
    """The benchmark on the trained model's own indexer inputs
    (experiments.benchmarks.indexer_real), or None when no lengths are asked for; a note
    when there is no checkpoint."""
    lengths = [int(x) for x in args.real_lengths.split(",") if x]
    if not lengths:
        return None
    from experiments.data import Corpus
    from model.checkpoint import CheckpointMissingError, load_default_model
    if getattr(args, "model", None):  # a pretrained model and its held-out real text
        from experiments.text_corpus import heldout_text_tokens
        from model.pretrained import load_pretrained

        pre = load_pretrained(args.model, max_seq_len=max(lengths),
                              rope_scaling=max(1.0, max(lengths) / 8192))
        model, heldout, name = pre.model, heldout_text_tokens(pre.tokenizer), args.model
    else:
        try:
            model, metadata = load_default_model(args.checkpoint)
        except CheckpointMissingError as e:
            return {"skipped": str(e), "markdown": f"Real-model inputs skipped: {e}"}
        heldout = Corpus(heldout_fraction=metadata.get("data", {}).get(
            "heldout_fraction", 0.05)).heldout_tokens
        name = str(args.checkpoint or "checkpoints/small")
    if args.smoke:  # budgets below the 1K smoke context
        config = config.replace(block_size=16, candidate_tokens=model.config.top_k)
    rows = bench_real(model, heldout, lengths, args, config)
    return {"checkpoint": name, "config": config.to_dict(), "rows": rows,
            "markdown": markdown_real(rows, config, name)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8192,16384,32768,65536")
    p.add_argument("--queries", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-length", type=int, default=32768)
    p.add_argument("--decode-repeats", type=int, default=20)
    p.add_argument("--exact-on-random", action="store_true",
                   help="also time exact mode on random inputs (slow: it rescores ~all blocks)")
    p.add_argument("--flat-chunk", type=int, default=128,
                   help="flat_topk's query_chunk (128 is its fastest here; its default is 512)")
    p.add_argument("--real-lengths", default="16384,32768",
                   help="lengths for the trained model's own indexer inputs ('' = none; "
                        "skipped with a note when there is no checkpoint)")
    p.add_argument("--real-queries", type=int, default=1024)
    p.add_argument("--real-flat-layers", default="0", metavar="I,J,...",
                   help="real-input rows also show the model with these layers kept flat "
                        "(ModelConfig.flat_index_layers; 'none' = no such column)")
    p.add_argument("--checkpoint", default=None, help="model directory (default: shipped)")
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="real inputs of a pretrained model instead (e.g. smollm2-135m; RoPE "
                        "interpolated by max(1, L / 8192) at the longest length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (tests, CI)")
    add_out_argument(p, "bench_indexer")
    args = p.parse_args(argv)
    try:
        parse_layers(args.real_flat_layers)  # syntax now; the range once the model is loaded
    except ValueError as e:
        p.error(f"--real-flat-layers: {e}")
    enable_compile_cache()
    small = get_config("small")
    H, d, top_k, config = small.index_heads, small.index_dim, small.top_k, small.hierarchical
    if args.smoke:
        print("SMOKE RUN: tiny indexer shapes on synthetic inputs (and the shipped model at 1K "
              "tokens); it checks the benchmark, its timings are not performance figures")
        H, d, top_k = 2, 16, 16
        config = HierarchicalConfig(block_size=16, candidate_tokens=64, query_tile=8,
                                    fine_batch_size=64, bound_blocks=1)
        args.lengths, args.queries, args.repeats = "512", 64, 1
        args.decode_length, args.decode_repeats = 512, 2
        args.real_lengths, args.real_queries = "1024", 32
    lengths = [int(x) for x in args.lengths.split(",") if x]
    result = {"setup": {"H": H, "d": d, "top_k": top_k, "queries": args.queries,
                        "flat_query_chunk": args.flat_chunk,
                        "repeats": args.repeats, "hierarchical": config.to_dict(),
                        "machine": machine_description(), "smoke": args.smoke},
              "lengths": []}
    for L in lengths:
        result["lengths"].append(bench_length(L, args, H, d, top_k, config))
        print(f"L={L} done", flush=True)
    if args.decode_length:
        result["decode"] = bench_decode(args.decode_length, args, H, d, top_k, config)
    table = markdown(result)
    real = real_model_rows(args, small.hierarchical)
    if real is not None:
        result["real"] = real
        table += "\n\n" + real["markdown"]
    print(table)
    result["markdown"] = table
    print(f"wrote {write_json(pathlib.Path(args.out) / 'bench_indexer.json', result)}")
    return result


if __name__ == "__main__":
    main()
