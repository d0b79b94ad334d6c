"""CPU rates for the cost model, measured in the run: each op kind timed on the modeled
config's shapes with the jnp references the model runs on CPU, best of a few repeats
(experiments.costmodel.rates holds the Rates they fill and the GPU rates)."""

import math
import os
import time

from experiments.costmodel.rates import Rates


def _best_seconds(fn, args, repeats):
    """Best of `repeats` timed calls after a compile + warm-up call. The best, not the
    median: other processes share the cores, and the fastest call is the least disturbed."""
    return _best_seconds_interleaved([(fn, args)], repeats)[0]


def _best_seconds_interleaved(calls, repeats):
    """Best seconds of each (fn, args) in `calls`, timed in turn `repeats` times after a
    compile + warm-up call each, so that every call sees the same spells of contention."""
    import jax

    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    best = [math.inf] * len(calls)
    for _ in range(repeats):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _looped(body):
    """jit of a loop running body on step i's slice of the inputs for i < n, n traced (one
    compile for every n), each step's output added into the carry so that none is dead."""
    import jax
    from jax import lax

    def run(xs, n, *shared):
        def one(i, acc):
            x = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)
            return acc + body(x, *shared)

        first = jax.eval_shape(lambda: body(jax.tree.map(lambda a: a[0], xs), *shared))
        return lax.fori_loop(0, n, one, jax.numpy.zeros(first.shape, first.dtype))

    return jax.jit(run)


def _step_seconds(body, steps_input, shared, repeats):
    """Seconds per loop step of body: (t(S steps) - t(1 step)) / (S - 1), S the leading size
    of steps_input. The implementation runs every selection op inside a loop over query
    chunks (lax.map), where buffers are reused from step to step; the difference drops what
    a call pays once (fresh buffers, first touch of their pages), which a lone call would
    mix into the rate."""
    import jax
    import jax.numpy as jnp

    fn = _looped(body)
    S = jax.tree.leaves(steps_input)[0].shape[0]
    t1, tS = _best_seconds_interleaved(
        [(fn, (steps_input, jnp.int32(n), *shared)) for n in (1, S)], repeats)
    # A difference lost in the noise (under 1/4 of a step of the long call): the mean step.
    return (tS - t1) / (S - 1) if tS - t1 > tS / (4 * S) else tS / S


def _in_place_seconds(x, repeats):
    """Best seconds of x * 2 + 1 written over x (a donated buffer: no fresh pages)."""
    import jax

    f = jax.jit(lambda x: x * 2.0 + 1.0, donate_argnums=0)
    x = jax.block_until_ready(f(x))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu_rates(config, repeats=3):
    """Times each op kind on this machine, in this run, with the config's indexer and
    attention shapes, per lax.map step (see _step_seconds): index scores and top-k on query
    chunks of 128 against 16384 keys (the regime of long contexts, where a chunk's
    intermediates outgrow the caches), the shorter fine-stage and attention ops on chunks
    of 512. About five seconds in all."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from indexer.scoring import threshold_topk
    from pallas_kernels.gathered_index_scores import gathered_index_scores_reference
    from pallas_kernels.index_scores import index_scores_reference
    from pallas_kernels.sparse_attention import sparse_attention_reference

    c, hc = config, config.hierarchical
    dt = jnp.dtype(c.dtype)
    H, d, K, B = c.index_heads, c.index_dim, c.top_k, hc.block_size
    rng = np.random.default_rng(0)
    S, T, L = 4, 128, 16384

    def normal(*shape, dtype=dt):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype=dtype)

    def step(body, xs, *shared):
        return _step_seconds(body, xs, shared, repeats)

    times, counts = {}, {}
    a = normal(1024, 1024, dtype=jnp.float32)
    times["matmul"] = _best_seconds(jax.jit(jnp.dot), (a, a), repeats)
    counts["matmul"] = 2 * 1024 ** 3
    # Top-k at two row lengths -> a per-row cost (k log2 k) and a per-element cost.
    n1, n2 = max(1024, 2 * K), max(L, 8 * K)
    t1, t2 = (step(lambda x: lax.top_k(x, K)[1], normal(S, T, m, dtype=jnp.float32)) / T
              for m in (n1, n2))
    per_el = max((t2 - t1) / (n2 - n1), 1e-12)
    per_row = max(t1 - per_el * n1, 0.0) / (K * math.log2(max(K, 2)))
    # Index scores (the jnp reference: every query x key pair) as flat selection runs them,
    # feeding lax.top_k (another consumer lets XLA fuse differently): the step minus the
    # top-k just measured on rows of the same length. The largest share of a long flat
    # prefill: 6 steps and one more repeat. The floor of 1/4 of the step guards against a
    # top-k measured slower than the pair by noise.
    k = normal(L, d)
    both = _step_seconds(
        lambda x, k: lax.top_k(index_scores_reference(x[0], x[1], k, q_offset=L - T), K)[1],
        (normal(6, T, H, d), normal(6, T, H, dtype=jnp.float32)), (k,), repeats + 1)
    times["index_scores"] = max(both - T * t2, both / 4)
    counts["index_scores"] = 2 * H * d * T * L
    # Fine stage: the gathered reference over random blocks, a table of the config's size,
    # fine_batch_size queries per step as hierarchical_topk maps them.
    Tf = max(hc.query_tile, min(hc.fine_batch_size, 4 * T) // hc.query_tile * hc.query_tile)
    tile = min(hc.query_tile, Tf)
    n_union = (hc.tile_candidate_tokens or 2 * (hc.budget_tokens(L) or 4 * K)) // B
    n_union = max(1, min(n_union, L // B))
    table = jnp.asarray(rng.integers(0, L // B, (8, Tf // tile, n_union)), jnp.int32)
    times["gathered_scores"] = step(  # a short step: 8 of them, so the difference shows
        lambda x, k: jnp.max(gathered_index_scores_reference(
            x[0], x[1], k, x[2], block_size=B, q_offset=L - Tf), axis=1),
        (normal(8, Tf, H, d), normal(8, Tf, H, dtype=jnp.float32), table), k)
    counts["gathered_scores"] = 2 * H * d * Tf * n_union * B
    # Sparse attention: the reference over top_k random tokens per query.
    kv = normal(L, c.n_kv_heads, c.head_dim)
    idx = jnp.asarray(rng.integers(0, L, (S, 2 * T, K)), jnp.int32)
    times["sparse_attention"] = _step_seconds(  # noisy at this size: more repeats
        lambda x, kv: sparse_attention_reference(x[0], kv, kv, x[1]),
        (normal(S, 2 * T, c.n_heads, c.head_dim), idx), (kv,), repeats + 2)
    counts["sparse_attention"] = 4 * c.n_heads * c.head_dim * K * 2 * T
    # Sort (block tables, int32 rows) and the fast-ranking threshold select, at the config's
    # ranking width.
    width = max(K, (hc.budget_tokens(L) or 4 * K))
    ints = jnp.asarray(rng.integers(0, 1 << 30, (S, 2 * T, width)), jnp.int32)
    t_sort = step(lambda x: lax.sort(x, dimension=1), ints)
    sort_log = t_sort / (2 * T * width * math.log2(width))
    t_select = step(lambda x: threshold_topk(x, K)[1], normal(S, 2 * T, width, dtype=jnp.float32))
    select_element = t_select / (2 * T * width)
    # Memory: an elementwise pass in place (read + write 64 MB): the intermediates of the
    # memory ops live in buffers a call has already touched.
    bandwidth = 2 * 4 * (1 << 24) / _in_place_seconds(normal(1 << 24, dtype=jnp.float32),
                                                      repeats)
    flops = {kind: counts[kind] / times[kind] for kind in counts}
    flops["dense_attention"] = flops["matmul"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    sources = {kind: f"{flops[kind] / 1e9:.1f} GFLOP/s measured in this run "
               f"({counts[kind] / 1e9:.2f} GFLOP per step in {times[kind] * 1e3:.1f} ms)"
               for kind in counts}
    sources["matmul"] = sources["matmul"].replace(" per step", "")
    sources["dense_attention"] = "the matmul rate (dense attention is not timed on CPU)"
    sources["topk"] = (f"lax.top_k(k={K}) over rows of {n1} and of {n2}: "
                       f"{per_row * 1e9:.2f} ns per k log2 k per row + "
                       f"{per_el * 1e9:.2f} ns per element, measured in this run")
    sources["sort"] = (f"lax.sort of int32 rows of {width}: {sort_log * 1e9:.2f} ns per "
                       f"element x log2(row), measured in this run")
    sources["select"] = (f"threshold_topk(k={K}) over rows of {width}: "
                         f"{select_element * 1e9:.2f} ns per element, measured in this run")
    sources["memory"] = (f"{bandwidth / 1e9:.1f} GB/s: x * 2 + 1 in place over 64 MB, in "
                         f"this run")
    sources["roofline"] = ("no: each FLOP kind's rate was timed on the whole op, its memory "
                           "traffic included")
    sources["load_average"] = (f"{load:.2f} (1-minute load average while calibrating: other "
                               f"processes on these cores slow every measured rate)"
                               if load is not None else "unknown")
    return Rates("cpu (this machine)", flops, bandwidth, per_row, per_el, 0.0, sort_log,
                 roofline=False, select_element=select_element, sources=sources)
