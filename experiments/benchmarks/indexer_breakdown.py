"""Where the hierarchical indexer's time goes, step by step, next to flat's.

    python -m experiments.benchmarks.indexer_breakdown [--lengths 32768,65536] [--queries 2048]

The benchmark's FLOP ratio (experiments.benchmarks.indexer.flops_per_query) counts only the
score products: coarse (block means) and fine (candidate tokens). This times every step of
one query chunk (`fine_batch_size` queries, the unit hierarchical_topk maps over) on the
benchmark's structured inputs, each step jitted alone on the previous step's outputs, with
the default HierarchicalConfig and the `small` indexer dims:

  coarse     coarse_block_scores: the products with the block means        (counted)
  spread     spread_boosted_scores: priority of the bound slots
  select     select_candidate_blocks: top-k over the blocks per query
  table      tile_candidate_union + sort_blocks + table_slots
  fine       gathered_index_scores over each tile's table                  (counted)
  rank       the rest of fine_topk: each query's own candidates, top_k
and flat's two steps on the same chunk: index_scores (counted) and top_k over all keys.
The chunk is the last one (it sees every key); its times are scaled to all queries. Steps
timed alone are not fused with their neighbours (each writes its output to memory and the
next reads it back), so their sum exceeds the whole calls (hierarchical_topk, flat_topk),
given in the last rows; the shares show where the time goes.
"""

import argparse
import functools
import pathlib

import jax
import jax.numpy as jnp

import indexer
import pallas_kernels
from experiments.benchmarks.support import median_interleaved, structured_inputs
from experiments.common import (
    add_out_argument,
    enable_compile_cache,
    machine_description,
    write_json,
)
from indexer.block_summaries import block_summaries
from indexer.candidates import (
    select_candidate_blocks,
    sort_blocks,
    spread_boosted_scores,
    table_slots,
    tile_candidate_union,
)
from indexer.hierarchical import coarse_block_scores, fine_topk, hierarchical_plan
from indexer.scoring import topk_indices
from model import get_config


def step_functions(q, w, k, top_k, config, q_offset):
    """{step: zero-argument callable} for one chunk of queries q [C, H, d] at q_offset..,
    each step jitted alone with the previous steps' outputs as inputs."""
    C, H, _ = q.shape
    B = config.block_size
    plan = hierarchical_plan(config, C, k.shape[0], top_k, H)
    bound_blocks = min(config.bound_blocks, plan.n_cand)
    pos = q_offset + jnp.arange(C)
    summaries = block_summaries(k, B)
    coarse_fn = jax.jit(functools.partial(coarse_block_scores, block_size=B, q_offset=q_offset,
                                          q_positions=pos))
    spread_fn = jax.jit(spread_boosted_scores)
    select_fn = jax.jit(lambda coarse, bounds: select_candidate_blocks(
        coarse, pos, plan.n_cand, block_size=B, sink_blocks=config.sink_blocks,
        local_blocks=config.local_blocks, bound_scores=bounds if bound_blocks else None,
        bound_blocks=bound_blocks))

    @jax.jit
    def table_fn(cands):
        table = sort_blocks(tile_candidate_union(cands, plan.tile, plan.n_union,
                                                 n_blocks=plan.n_blocks,
                                                 bound_blocks=bound_blocks))
        cands = sort_blocks(cands)
        return table, cands, table_slots(table, cands, plan.tile, plan.n_blocks)

    # Every input is an argument: a jitted closure over arrays may be constant-folded.
    fine_fn = jax.jit(lambda q, w, k, table: pallas_kernels.gathered_index_scores(
        q, w, k, table, block_size=B, q_offset=q_offset))
    fine_topk_fn = jax.jit(lambda q, w, k, table, cands, slots: fine_topk(
        q, w, k, table, top_k, block_size=B, q_offset=q_offset, candidates=cands, slots=slots,
        fast_ranking=config.fast_ranking))
    flat_scores_fn = jax.jit(lambda q, w, k: indexer.index_scores(q, w, k, q_offset=q_offset))
    flat_topk_fn = jax.jit(lambda scores: topk_indices(scores, top_k))

    coarse = jax.block_until_ready(coarse_fn(q, w, summaries))
    bounds = jax.block_until_ready(spread_fn(coarse, q, w, summaries))
    cands = jax.block_until_ready(select_fn(coarse, bounds))
    table, sorted_cands, slots = jax.block_until_ready(table_fn(cands))
    flat_scores = jax.block_until_ready(flat_scores_fn(q, w, k))
    steps = {
        "coarse": lambda: coarse_fn(q, w, summaries),
        "spread": lambda: spread_fn(coarse, q, w, summaries),
        "select": lambda: select_fn(coarse, bounds),
        "table": lambda: table_fn(cands),
        "fine": lambda: fine_fn(q, w, k, table),
        "fine+rank": lambda: fine_topk_fn(q, w, k, table, sorted_cands, slots),
        "flat scores": lambda: flat_scores_fn(q, w, k),
        "flat top_k": lambda: flat_topk_fn(flat_scores),
    }
    flops = {"coarse": 2 * H * k.shape[1] * plan.n_blocks * C,
             "fine": 2 * H * k.shape[1] * plan.n_union * B * C,
             "flat scores": 2 * H * k.shape[1] * k.shape[0] * C}
    return steps, flops


def breakdown(L, n_queries, top_k, config, H, d, repeats, seed=0):
    """Per-step seconds for n_queries queries (chunk times x chunks) and the whole calls."""
    q, w, k, _ = (jnp.asarray(a) for a in structured_inputs(seed, L, n_queries, H, d))
    C = config.fine_batch_size
    q_offset = L - n_queries
    steps, flops = step_functions(q[-C:], w[-C:], k, top_k, config, L - C)
    for fn in steps.values():
        jax.block_until_ready(fn())
    chunk_s = median_interleaved(steps, repeats)
    scale = n_queries / C
    rows = {name: t * scale for name, t in chunk_s.items()}
    rows["rank"] = rows.pop("fine+rank") - rows["fine"]
    summaries = block_summaries(k, config.block_size)
    whole = {"hierarchical_topk": lambda: indexer.hierarchical_topk(
                 q, w, k, top_k, config, q_offset=q_offset, summaries=summaries),
             "flat_topk": lambda: indexer.flat_topk(q, w, k, top_k, q_offset=q_offset,
                                                    query_chunk=C)}
    for fn in whole.values():
        jax.block_until_ready(fn())
    rows.update(median_interleaved(whole, repeats))
    return {"length": L, "queries": n_queries, "seconds": rows,
            "gflop": {name: f * scale / 1e9 for name, f in flops.items()}}


def markdown(result):
    hier = ("coarse", "spread", "select", "table", "fine", "rank")
    lines = ["| L | step | seconds | share | GFLOP (counted) | GFLOP/s |",
             "|---|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        s, g = row["seconds"], row["gflop"]
        for group, names in (("hierarchical", hier), ("flat", ("flat scores", "flat top_k"))):
            total = sum(s[n] for n in names)
            for n in names:
                gf = f"{g[n]:.1f} | {g[n] / s[n]:.0f}" if n in g else "- | -"
                lines.append(f"| {row['length']} | {n} | {s[n]:.4f} | {s[n] / total:.0%} | {gf} |")
            lines.append(f"| {row['length']} | **{group} steps, sum** | {total:.4f} | | | |")
        lines.append(f"| {row['length']} | hierarchical_topk (whole) | "
                     f"{s['hierarchical_topk']:.4f} | | | |")
        lines.append(f"| {row['length']} | flat_topk (whole) | {s['flat_topk']:.4f} | | | |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="32768,65536")
    p.add_argument("--queries", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (tests)")
    add_out_argument(p, "indexer_breakdown")
    args = p.parse_args(argv)
    enable_compile_cache()
    small = get_config("small")
    H, d, top_k, config = small.index_heads, small.index_dim, small.top_k, small.hierarchical
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.smoke:
        print("SMOKE RUN: tiny shapes; it checks the breakdown, its timings are not "
              "performance figures")
        H, d, top_k = 2, 16, 16
        config = config.replace(block_size=16, candidate_tokens=64, query_tile=8,
                                fine_batch_size=32, bound_blocks=1)
        lengths, args.queries, args.repeats = [300], 64, 1
    if not 1 <= args.queries <= min(lengths) or args.queries % config.fine_batch_size:
        p.error(f"--queries must be a multiple of fine_batch_size ({config.fine_batch_size}) "
                f"in [1, {min(lengths)}], got {args.queries}")
    result = {"machine": machine_description(), "H": H, "d": d, "top_k": top_k,
              "hierarchical": config.to_dict(),
              "rows": [breakdown(L, args.queries, top_k, config, H, d, args.repeats)
                       for L in lengths]}
    result["markdown"] = markdown(result)
    print(result["markdown"])
    print(f"wrote {write_json(pathlib.Path(args.out) / 'indexer_breakdown.json', result)}")
    return result


if __name__ == "__main__":
    main()
