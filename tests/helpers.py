"""Shared test helpers: fresh random inputs (never zeros) and brute-force references."""

import jax
import numpy as np


def random_indexer_inputs(seed, T, L, H=4, d=16, dtype=np.float32):
    """q [T, H, d], w [T, H] (both signs), k [L, d]; standard normal, seeded."""
    kq, kw, kk = jax.random.split(jax.random.key(seed), 3)
    q = np.asarray(jax.random.normal(kq, (T, H, d)), dtype)
    w = np.asarray(jax.random.normal(kw, (T, H)), np.float32)
    k = np.asarray(jax.random.normal(kk, (L, d)), dtype)
    return q, w, k


def brute_force_scores(q, w, k, q_offset=0):
    """numpy I[t, s] with -inf for s > q_offset + t (float64)."""
    logits = np.einsum("thd,ld->thl", q.astype(np.float64), k.astype(np.float64))
    scores = np.einsum("thl,th->tl", np.maximum(logits, 0.0), w.astype(np.float64))
    T, L = scores.shape
    future = np.arange(L)[None, :] > (q_offset + np.arange(T))[:, None]
    scores[future] = -np.inf
    return scores
