"""Would exact mode prune if the keys were grouped by similarity instead of by position?

    python -m experiments.studies.cluster_bounds [--lengths 32768] [--clusters 512,4096]
        [--queries 1024]

Exact mode (indexer.exact) skips a group of keys when its upper bound, from the group's
min/max keys, mean and radius, cannot reach the query's k-th score. On the trained model's
real inputs contiguous 64-token blocks let 91-96% through (docs/findings.md): a block of code holds
nearly every kind of byte key. This study groups the same keys by k-means instead and
applies the same bounds (`indexer.exact.block_upper_bounds` over the groups' summaries),
per layer of the shipped model on held-out text: the share of keys whose group bound
reaches the k-th score (what exact mode would rescore), next to the floor (the keys of the
groups that hold a flat top-k token, which any bound must let through). The bound products
cost 3 x groups / L of flat's products on top.
"""

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import indexer
from experiments.common import (
    add_out_argument,
    enable_compile_cache,
    machine_description,
    write_json,
)
from indexer.block_summaries import BlockSummaryCache
from indexer.exact import block_upper_bounds


@jax.jit
def _nearest(k, centers):
    d2 = (jnp.sum(centers * centers, axis=1)[None, :] - 2.0 * k @ centers.T)
    return jnp.argmin(d2, axis=1).astype(jnp.int32)


def kmeans(k, n_clusters, *, iters=8, seed=0):
    """Lloyd's k-means of keys k f32[L, d] -> assignment i32[L] (empty clusters keep their
    center; some may stay empty). Centers start at n_clusters distinct keys."""
    L = k.shape[0]
    if not 1 <= n_clusters <= L:
        raise ValueError(f"n_clusters must be in [1, L = {L}], got {n_clusters}")
    k = jnp.asarray(k, jnp.float32)
    centers = k[jax.random.choice(jax.random.key(seed), L, (n_clusters,), replace=False)]
    for _ in range(iters):
        assign = _nearest(k, centers)
        sums = jax.ops.segment_sum(k, assign, n_clusters)
        counts = jax.ops.segment_sum(jnp.ones(L), assign, n_clusters)[:, None]
        centers = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), centers)
    return np.asarray(_nearest(k, centers))


def group_summaries(k, assign, n_groups):
    """BlockSummaryCache over arbitrary groups of keys (group g = keys with assign == g):
    sum, count, min, max and radius (as block_summaries gives for complete blocks)."""
    k = np.asarray(k, np.float32)
    d = k.shape[1]
    count = np.bincount(assign, minlength=n_groups)
    total = np.zeros((n_groups, d), np.float64)
    np.add.at(total, assign, k)
    lo = np.full((n_groups, d), np.inf, np.float32)
    hi = np.full((n_groups, d), -np.inf, np.float32)
    np.minimum.at(lo, assign, k)
    np.maximum.at(hi, assign, k)
    mean = total / np.maximum(count, 1)[:, None]
    radius = np.zeros(n_groups, np.float64)
    np.maximum.at(radius, assign, np.linalg.norm(k - mean[assign], axis=1))
    radius = np.where(count > 0, radius * (1 + 1e-5) + 1e-6, np.inf)  # rounding, as in blocks
    return BlockSummaryCache(sum=jnp.asarray(total, jnp.float32),
                             count=jnp.asarray(count, jnp.int32),
                             min=jnp.asarray(lo), max=jnp.asarray(hi),
                             radius=jnp.asarray(radius, jnp.float32))


def rescore_fractions(q, w, k, top_k, assign, n_groups, *, q_offset):
    """Per query (query i at q_offset + i), the share of its visible keys whose group bound
    reaches its k-th flat score, and the floor (visible keys of the groups holding one of
    its flat top-k tokens), averaged over queries; also the same two shares of groups."""
    T = q.shape[0]
    summaries = group_summaries(k, assign, n_groups)
    # Groups mix positions, so every non-empty group counts as visible (its bound covers
    # all its keys, a superset of the visible ones: still an upper bound).
    bounds = np.asarray(block_upper_bounds(jnp.asarray(q), jnp.asarray(w), summaries,
                                           block_size=1,
                                           q_positions=jnp.full((T,), n_groups, jnp.int32)))
    scores = np.asarray(indexer.index_scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k),
                                             q_offset=q_offset))
    top = np.asarray(indexer.topk_indices(jnp.asarray(scores), top_k))
    keys, floor, groups, floor_groups, violations = [], [], [], [], 0
    for i in range(T):
        n_visible = min(q_offset + i + 1, k.shape[0])
        visible_assign = assign[:n_visible]
        sizes = np.bincount(visible_assign, minlength=n_groups)
        row = top[i][top[i] >= 0]
        kth = scores[i, row[-1]] if row.size == top_k else -np.inf
        passing = bounds[i] >= kth
        holding = np.zeros(n_groups, bool)
        holding[assign[row]] = True
        violations += int(np.sum(holding & ~passing))
        keys.append(sizes[passing].sum() / n_visible)
        floor.append(sizes[holding].sum() / n_visible)
        groups.append(np.mean(passing[sizes > 0]))
        floor_groups.append(np.mean(holding[sizes > 0]))
    return {"keys_rescored": float(np.mean(keys)), "keys_floor": float(np.mean(floor)),
            "groups_passing": float(np.mean(groups)), "groups_floor": float(np.mean(floor_groups)),
            "bound_violations": violations}


def study_layer(q, w, k, top_k, clusters, *, q_offset, block_size=64, seed=0):
    """Contiguous blocks of block_size vs k-means groups of each size in `clusters`."""
    L = k.shape[0]
    rows = {f"blocks of {block_size}": rescore_fractions(
        q, w, k, top_k, np.arange(L) // block_size, -(-L // block_size), q_offset=q_offset)}
    for n in clusters:
        rows[f"k-means {n}"] = rescore_fractions(q, w, k, top_k, kmeans(k, n, seed=seed), n,
                                                 q_offset=q_offset)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="32768")
    p.add_argument("--clusters", default="512,4096", help="k-means group counts")
    p.add_argument("--queries", type=int, default=1024, help="last queries of each context")
    p.add_argument("--checkpoint", default=None, help="model directory (default: shipped)")
    add_out_argument(p, "cluster_bounds")
    args = p.parse_args(argv)
    from experiments.data import Corpus, eval_sequence, model_indexer_inputs
    from model.checkpoint import load_default_model

    enable_compile_cache()
    clusters = [int(x) for x in args.clusters.split(",") if x]
    model, metadata = load_default_model(args.checkpoint)
    corpus = Corpus(heldout_fraction=metadata.get("data", {}).get("heldout_fraction", 0.05))
    top_k = model.config.top_k
    result = {"machine": machine_description(), "top_k": top_k, "rows": []}
    print("| L | layer | grouping | keys rescored | floor | groups passing | floor |")
    print("|---|---|---|---:|---:|---:|---:|")
    for L in (int(x) for x in args.lengths.split(",") if x):
        n = min(args.queries, L)
        t0 = time.perf_counter()
        layers = model_indexer_inputs(model, eval_sequence(corpus.heldout_tokens, L), n)
        for layer, (q, w, k) in enumerate(layers):
            for name, r in study_layer(q, w, k, top_k, clusters, q_offset=L - n).items():
                result["rows"].append({"length": L, "layer": layer, "grouping": name, **r})
                print(f"| {L} | {layer} | {name} | {r['keys_rescored']:.3f} | "
                      f"{r['keys_floor']:.3f} | {r['groups_passing']:.3f} | "
                      f"{r['groups_floor']:.3f} |", flush=True)
        print(f"L={L}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"wrote {write_json(pathlib.Path(args.out) / 'cluster_bounds.json', result)}")
    return result


if __name__ == "__main__":
    main()
