"""Ranking a fine-stage row: the top_k of each query's candidate tokens, four ways.

    python -m experiments.benchmarks.ranking [--widths 1408,4096,5120,8192,12288] [--top-k 1024]

Rows shaped as the hierarchical fine stage hands them over: candidate tokens oldest first,
recent tokens scoring higher (noise on a rising trend), the first 1/16 of the columns
invisible (-inf). Per width, interleaved rounds (median), per 1024 rows:

  lax.top_k          in token order (exact mode's ranking; XLA's CPU top_k is a heap);
  newest first       lax.top_k over the reversed row (the fast ranking before 2026-12-05
                     past 4096 columns);
  packed sort        one lax.sort of int32 keys packing each score's order bits with its
                     column (the fast ranking before 2026-12-05 up to 4096 columns,
                     hierarchical.packed_topk; its ties are coarser past 4096 columns);
  threshold          indexer.scoring.threshold_topk (the fast ranking now).

Each is checked against lax.top_k: the same set, or values within the threshold's window.
"""

import argparse
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.support import median_interleaved
from experiments.common import (
    add_out_argument,
    enable_compile_cache,
    machine_description,
    recorded_command,
    write_json,
)
from indexer.scoring import threshold_topk

ROWS = 128  # hierarchical_topk's fine_batch_size: the rows of one lax.map step


def fine_stage_rows(steps, width, seed):
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((steps, ROWS, width), dtype=np.float32)
    rows += np.linspace(0.0, 3.0, width, dtype=np.float32)
    rows[:, :, :width // 16] = -np.inf
    return jnp.asarray(rows)


def newest_first(scores, top_k):
    values, cols = jax.lax.top_k(jnp.flip(scores, axis=1), top_k)
    return values, scores.shape[1] - 1 - cols


def packed_sort(scores, top_k):
    C = scores.shape[1]
    low = (1 << max(1, (C - 1).bit_length())) - 1
    raw = jax.lax.bitcast_convert_type(scores, jnp.int32)
    order = jnp.where(raw < 0, raw ^ jnp.int32(0x7FFFFFFF), raw)
    packed = (order & jnp.int32(~low)) | (low - jnp.arange(C, dtype=jnp.int32))
    cols = low - (jnp.flip(jax.lax.sort(packed, dimension=1)[:, C - top_k:], axis=1) & low)
    return jnp.take_along_axis(scores, cols, axis=1), cols


RANKERS = {"lax.top_k": jax.lax.top_k, "newest first": newest_first, "packed sort": packed_sort,
           "threshold": threshold_topk}


def bench_width(width, top_k, steps, repeats):
    rows = fine_stage_rows(steps, width, width)
    fns = {name: jax.jit(functools.partial(
        lambda x, f: jax.lax.map(lambda r: f(r, top_k)[0], x), f=f)) for name, f in
        RANKERS.items()}
    want = np.sort(np.asarray(fns["lax.top_k"](rows)).reshape(-1, top_k), axis=1)
    finite = np.isfinite(want)
    out = {"width": width, "top_k": top_k, "rows": steps * ROWS}
    for name, fn in fns.items():
        got = np.sort(np.asarray(fn(rows)).reshape(-1, top_k), axis=1)
        same = np.array_equal(np.isfinite(got), finite)
        out[name] = {"max_value_error": float(np.max(np.abs(got - want)[finite]))
                     if same and finite.any() else (0.0 if same else float("inf"))}
    times = median_interleaved({name: functools.partial(fn, rows) for name, fn in fns.items()},
                               repeats)
    for name, seconds in times.items():
        out[name]["ms_per_1024_rows"] = seconds * 1e3 * 1024 / (steps * ROWS)
    return out


def markdown(result):
    lines = [f"# Ranking a fine-stage row (top_k {result['top_k']})", "",
             f"Command: `{result['command']}`", "",
             "| columns | " + " | ".join(f"{n} ms" for n in RANKERS)
             + " | threshold speedup vs fastest other | threshold max value error |",
             "|---|" + "---:|" * (len(RANKERS) + 2)]
    for r in result["widths"]:
        others = min(r[n]["ms_per_1024_rows"] for n in RANKERS if n != "threshold")
        lines.append(f"| {r['width']} | " + " | ".join(
            f"{r[n]['ms_per_1024_rows']:.1f}" for n in RANKERS)
            + f" | {others / r['threshold']['ms_per_1024_rows']:.2f}x"
            f" | {r['threshold']['max_value_error']:.2g} |")
    lines += ["", "ms per 1024 rows (median of interleaved rounds); value errors against "
              "lax.top_k's values, sorted (the packed sort's: "
              + ", ".join(f"{r['packed sort']['max_value_error']:.2g}" for r in result["widths"])
              + ")."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", default="1408,4096,5120,8192,12288")
    p.add_argument("--top-k", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8, help="lax.map steps of 128 rows each")
    p.add_argument("--repeats", type=int, default=5)
    add_out_argument(p, "ranking")
    args = p.parse_args(argv)
    enable_compile_cache()
    widths = [int(x) for x in args.widths.split(",")]
    bad = [w for w in widths if w < args.top_k]
    if bad or args.top_k < 1:
        p.error(f"--widths must each be >= --top-k ({args.top_k} >= 1), got {bad}")
    result = {"command": recorded_command("experiments.benchmarks.ranking", argv),
              "machine": machine_description(), "top_k": args.top_k,
              "widths": [bench_width(w, args.top_k, args.steps, args.repeats) for w in widths]}
    result["markdown"] = markdown(result)
    out = pathlib.Path(args.out)
    write_json(out / "ranking.json", result)
    (out / "ranking.md").write_text(result["markdown"])  # the folder exists now
    print(result["markdown"])
    return result


if __name__ == "__main__":
    main()
