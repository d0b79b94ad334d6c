"""Shared test helpers: fresh random inputs (never zeros) and brute-force references."""

import pathlib
import random
import socket

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


_handed_out = set()


def free_port():
    """A TCP port nothing listens on, taken below the kernel's ephemeral range.

    A port the kernel hands out for bind(0) comes from the ephemeral range, which is also
    where every outgoing connection takes its local port: a server started a moment later
    on it can find it held by another process's connection (a CI run's heartbeat listener
    met "Address already in use" so). Ports below that range are only ever taken by a
    bind that names them."""
    low = 32768
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port found between 10000 and {low}")
