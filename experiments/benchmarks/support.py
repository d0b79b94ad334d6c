"""Shared pieces of the indexer benchmarks: seeded synthetic inputs, interleaved timing,
jitted block summaries, and a tie-aware equality of selections."""

import statistics
import time

import jax
import numpy as np

from indexer.block_summaries import block_summaries

jit_block_summaries = jax.jit(block_summaries, static_argnames=("block_size",))


def random_inputs(seed, L, n_queries, H, d):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_queries, H, d), np.float32)
    w = rng.standard_normal((n_queries, H), np.float32)
    k = rng.standard_normal((L, d), np.float32)
    return q, w, k, np.zeros(0, np.int64)


def _walk(rng, n, shape, step):
    """Stationary AR(1) random walk: unit variance per coordinate, correlation 1 - step^2/2."""
    z = rng.standard_normal((n,) + shape).astype(np.float32)
    x = np.empty_like(z)
    x[0] = z[0]
    keep = np.float32(np.sqrt(1 - step * step))
    for i in range(1, n):
        x[i] = keep * x[i - 1] + np.float32(step) * z[i]
    return x


def structured_inputs(seed, L, n_queries, H, d, *, center=0.99, n_needles=4, needle_gain=4.0,
                      aligned=True):
    """Keys with locality + drifting queries + needles (see the module docstring).
    aligned: segments of 64 tokens (a random walk per block), else random lengths in
    [32, 96] that straddle blocks. Returns q [n, H, d], w [n, H], k [L, d], needle positions."""
    rng = np.random.default_rng(seed)
    lengths = np.full(L // 64 + 1, 64) if aligned else rng.integers(32, 97, size=L // 32 + 1)
    segment = np.repeat(np.arange(len(lengths)), lengths)[:L]
    centers = _walk(rng, len(lengths), (d,), 0.5)
    k = center * centers[segment] + np.sqrt(1 - center**2) * rng.standard_normal((L, d))
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    needles = np.sort(rng.choice(np.arange(64, L // 2), n_needles, replace=False))
    k[needles] = np.sqrt(d) * u + 0.3 * rng.standard_normal((n_needles, d))
    q_base = _walk(rng, n_queries, (H, d), 0.03)
    q = np.sqrt(1 - 0.3**2) * q_base + 0.3 * rng.standard_normal((n_queries, H, d))
    q = (q + needle_gain * u) / np.sqrt(d)
    w_base = _walk(rng, n_queries, (H,), 0.03)
    w = 0.7 + 0.7 * (np.sqrt(1 - 0.2**2) * w_base + 0.2 * rng.standard_normal((n_queries, H)))
    return (q.astype(np.float32), w.astype(np.float32), k.astype(np.float32), needles)


def median_interleaved(fns, repeats):
    """{name: median seconds}: runs every fn once per round so load drifts hit all alike."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def equal_up_to_ties(q, w, k, got, want):
    """True when every row selects the same set as flat, or a set with the same scores."""
    q, w, k = np.asarray(q, np.float64), np.asarray(w, np.float64), np.asarray(k, np.float64)
    for t in range(got.shape[0]):
        a, b = got[t][got[t] >= 0], want[t][want[t] >= 0]
        if len(a) != len(b):
            return False
        if set(a.tolist()) == set(b.tolist()):
            continue
        sa, sb = (np.sort(np.maximum(q[t] @ k[x].T, 0).T @ w[t]) for x in (a, b))
        if not np.allclose(sa, sb, rtol=1e-4, atol=1e-4):
            return False
    return True
