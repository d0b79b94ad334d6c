"""The indexer benchmark on the trained model's own indexer inputs (real text).

Called by `python -m experiments.benchmarks.indexer` (`--real-lengths`, on by default when the
shipped checkpoint exists). For each length L the model reads L held-out bytes
(experiments.data, the split the checkpoint was trained without); the indexer queries and
weights of its last `--real-queries` positions and each layer's whole key cache are kept
(experiments.indexer_inputs). Per layer, side by side in one run: flat, hierarchical at the
configured candidate budget and at 2x and 4x it, and exact mode, with recall and IoU
against flat and the block-recall ceiling (indexer.block_recall_ceiling: what the best
possible choice of that many blocks would reach, whatever the coarse scorer). With
`--real-flat-layers`, each budget also gets the figures of the model with those layers kept
flat (ModelConfig.flat_index_layers): their measured flat time and recall 1 in place of
their hierarchical ones.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import indexer
from experiments.benchmarks.support import equal_up_to_ties, jit_block_summaries, median_interleaved
from experiments.common import parse_layers


def budgets(config, factors=(1, 2, 4)):
    """Candidate budgets in tokens: the configured one times each factor."""
    base = config.candidate_tokens or config.block_size
    return [base * f for f in factors]


def bench_layer(q, w, k, top_k, config, q_offset, args):
    """One layer's inputs -> dict of times and selection quality for every budget."""
    B = config.block_size
    summaries = jax.block_until_ready(jit_block_summaries(k, block_size=B))
    exact_config = config.replace(exact=True)
    fns = {"flat": lambda: indexer.flat_topk(q, w, k, top_k, q_offset=q_offset,
                                             query_chunk=args.flat_chunk),
           "exact": lambda: indexer.hierarchical_topk_with_stats(
               q, w, k, top_k, exact_config, q_offset=q_offset, summaries=summaries)}
    for tokens in budgets(config):
        cfg = config.replace(candidate_tokens=tokens)
        fns[tokens] = (lambda c: lambda: indexer.hierarchical_topk(
            q, w, k, top_k, c, q_offset=q_offset, summaries=summaries))(cfg)
    outs = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}  # warm-up
    times = median_interleaved(fns, args.repeats)
    flat = np.asarray(outs["flat"])
    exact, stats = outs["exact"]
    res = {"flat_s": times["flat"], "exact_s": times["exact"],
           "exact_equals_flat": equal_up_to_ties(q, w, k, np.asarray(exact), flat),
           "exact_rescored_fraction": float(stats["rescored_fraction"]),
           "exact_scored_fraction": float(stats["scored_fraction"]),
           "exact_floor_fraction": indexer.topk_block_fraction(
               flat, B, q_offset + np.arange(q.shape[0])),
           "exact_rounds": int(stats["rounds"]), "budgets": {}}
    for tokens in budgets(config):
        hier = np.asarray(outs[tokens])
        res["budgets"][tokens] = {
            "hierarchical_s": times[tokens],
            "recall": indexer.recall(hier, flat), "iou": indexer.iou(hier, flat),
            "ceiling": indexer.block_recall_ceiling(flat, -(-tokens // B), B)}
    return res


def with_flat_layers(per_layer, tokens, flat_layers):
    """Speedup and recall at budget `tokens` when flat_layers keep flat selection."""
    time_s = sum(r["flat_s"] if i in flat_layers else r["budgets"][tokens]["hierarchical_s"]
                 for i, r in enumerate(per_layer))
    recall = np.mean([1.0 if i in flat_layers else r["budgets"][tokens]["recall"]
                      for i, r in enumerate(per_layer)])
    return {"layers": list(flat_layers), "speedup": sum(r["flat_s"] for r in per_layer) / time_s,
            "recall": float(recall)}


def bench_real(model, heldout_tokens, lengths, args, config, log=print):
    """Rows of the real-input benchmark, one per length (layers inside)."""
    from experiments.data import eval_sequence, model_indexer_inputs

    top_k = model.config.top_k
    # ModelConfig checks the indices (distinct, in range) as for the model itself.
    flat_layers = model.config.replace(
        flat_index_layers=parse_layers(getattr(args, "real_flat_layers", ""))).flat_index_layers
    rows = []
    for L in lengths:
        n = min(args.real_queries, L)
        t0 = time.perf_counter()
        layers = model_indexer_inputs(model, eval_sequence(heldout_tokens, L), n)
        log(f"real L={L}: indexer inputs of {len(layers)} layers in "
            f"{time.perf_counter() - t0:.1f}s", flush=True)
        per_layer = [bench_layer(*(jnp.asarray(a) for a in layer), top_k, config, L - n, args)
                     for layer in layers]
        row = {"length": L, "queries": n, "layers": per_layer,
               "flat_s": sum(r["flat_s"] for r in per_layer),
               "exact_s": sum(r["exact_s"] for r in per_layer),
               "exact_equals_flat": all(r["exact_equals_flat"] for r in per_layer),
               **{f: float(np.mean([r[f] for r in per_layer])) for f in (
                   "exact_rescored_fraction", "exact_scored_fraction", "exact_floor_fraction")},
               "budgets": {}}
        for tokens in budgets(config):
            parts = [r["budgets"][tokens] for r in per_layer]
            row["budgets"][tokens] = {
                "hierarchical_s": sum(p["hierarchical_s"] for p in parts),
                "speedup": row["flat_s"] / sum(p["hierarchical_s"] for p in parts),
                **{m: float(np.mean([p[m] for p in parts])) for m in ("recall", "iou", "ceiling")},
                "recall_per_layer": [p["recall"] for p in parts],
                "ceiling_per_layer": [p["ceiling"] for p in parts]}
            if flat_layers:
                row["budgets"][tokens]["with_flat_layers"] = with_flat_layers(
                    per_layer, tokens, flat_layers)
        rows.append(row)
    return rows


def markdown_real(rows, config, checkpoint):
    first = next(iter(rows[0]["budgets"].values()))
    mixed = ",".join(map(str, first.get("with_flat_layers", {}).get("layers", [])))
    lines = [
        f"Trained model's own indexer inputs ({checkpoint}; held-out stdlib text), all layers "
        f"(times summed over layers), last {rows[0]['queries']} queries; hierarchical as "
        f"above except the candidate budget. ceiling = best recall any choice of that many "
        f"blocks of {config.block_size} can reach.",
        "",
        "| L | candidate tokens | flat s | hier s | speedup | recall | IoU | ceiling "
        "| recall per layer | ceiling per layer |" + (f" layers {mixed} flat: speedup, recall |"
                                                         if mixed else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if mixed else ""),
    ]
    for row in rows:
        for tokens, b in row["budgets"].items():
            per = " / ".join(f"{x:.3f}" for x in b["recall_per_layer"])
            ceil = " / ".join(f"{x:.3f}" for x in b["ceiling_per_layer"])
            extra = (f" {b['with_flat_layers']['speedup']:.2f}x, "
                     f"{b['with_flat_layers']['recall']:.4f} |" if mixed else "")
            lines.append(f"| {row['length']} | {tokens} | {row['flat_s']:.3f} | "
                         f"{b['hierarchical_s']:.3f} | {b['speedup']:.2f}x | {b['recall']:.4f} | "
                         f"{b['iou']:.4f} | {b['ceiling']:.4f} | {per} | {ceil} |" + extra)
    lines += ["", "Exact mode on the same inputs (configured budget, then refinement): "
              + ", ".join(
        f"{row['length']}: {row['exact_s']:.3f} s vs flat {row['flat_s']:.3f} s "
        f"({row['flat_s'] / row['exact_s']:.2f}x), equals flat: "
        f"{'yes' if row['exact_equals_flat'] else 'NO'}, rescored "
        f"{row['exact_rescored_fraction']:.1%} of blocks (scored in all "
        f"{row['exact_scored_fraction']:.1%}; the blocks holding a flat top-k token, which any "
        f"bound must let through, are {row['exact_floor_fraction']:.1%})" for row in rows)]
    return "\n".join(lines)
