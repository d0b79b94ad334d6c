"""The machine's own limit beside every TTFT: the f32 matmul rate measured in the study's
process on the model's own shape, and each (mode, length)'s model FLOPs over its TTFT.

A TTFT alone says little across machines (the 2-core CPUs here differ by ~2x); the share of
the matmul rate a prefill reaches says how far the implementation is from what the cores
do, which is the figure a faster kernel has to move.
"""

import math
import time

import jax
import jax.numpy as jnp

from model.costs import prefill_counts

MATMUL_REPEATS = 5


def matmul_rate(config, repeats=MATMUL_REPEATS):
    """{"gflops", "shape"}: the best of `repeats` f32 products of the model's own MLP shape,
    [prefill_chunk, d_model] x [d_model, d_ff] (after a compile + warm-up call), in FLOP/s
    / 1e9. f32 whatever the model's dtype: the CPU path computes in f32."""
    rows, d_in, d_out = config.prefill_chunk, config.d_model, config.d_ff
    a = jax.random.normal(jax.random.key(0), (rows, d_in), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (d_in, d_out), jnp.float32)
    product = jax.jit(jnp.dot)
    jax.block_until_ready(product(a, b))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(product(a, b))
        best = min(best, time.perf_counter() - t0)
    return {"gflops": 2 * rows * d_in * d_out / best / 1e9,
            "shape": f"f32 [{rows}, {d_in}] x [{d_in}, {d_out}]"}


def model_flops(config, length):
    """The model FLOPs of a prefill of `length` tokens under `config` (a mode's config),
    from model.costs: the layers' linear and MLP work, attention over the keys each query
    sees (sparse: its selection, at most top_k; dense: every causal key) and, when sparse,
    each layer's selection as its kind counts it (hierarchical: the blocks and candidates it
    scores). Causal pairs only (skip=True): what a prefill has to do, not the masked work an
    implementation may add."""
    stages = prefill_counts(config, length, skip=True).total().totals()
    wanted = ("other", "attention", "indexer") if config.attention != "dense" else (
        "other", "dense_attention")
    return sum(stages.get(stage, {}).get("flops", 0.0) for stage in wanted)


def add_rates(rows, rate):
    """Fills achieved_gflops (model_tflop over the fastest TTFT) and matmul_share (of
    `rate`, matmul_rate's gflops) into each timed row that has model_tflop (in place)."""
    for row in rows:
        t = row.get("ttft_ms")
        if row.get("model_tflop") is None or t is None:
            continue
        row["achieved_gflops"] = row["model_tflop"] * 1e3 / (t["min"] / 1e3)
        row["matmul_share"] = row["achieved_gflops"] / rate
