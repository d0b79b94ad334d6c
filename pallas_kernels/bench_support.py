"""Helpers of the kernel benchmark (pallas_kernels.bench): timing, inputs, error checks,
the bench-local kernel dispatch and the whole-sequence selection pipelines.

The hierarchical pipeline here is deliberately self-contained (pallas_kernels may not import
indexer: dependencies point one way); indexer.hierarchical_topk is the product version.
"""

import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gathered_index_scores import (
    GatheredScoresConfig, gathered_index_scores_pallas, gathered_index_scores_reference)
from pallas_kernels.index_scores import (
    IndexScoresConfig, index_scores_pallas, index_scores_reference)
from pallas_kernels.sparse_attention import (
    SparseAttentionConfig, sparse_attention_pallas, sparse_attention_reference)


# --------------------------------------------------------------------------- helpers

class Report:
    """Collects rows and errors; rewrites the JSON after every section."""

    def __init__(self, path, args):
        self.path = path
        self.t0 = time.perf_counter()
        self.data = {"args": {k: (sorted(v) if isinstance(v, set) else v)
                              for k, v in vars(args).items()},
                     "env": {}, "correctness": [], "tuning": [], "results": [],
                     "errors": [], "notes": []}
        self.budget = args.budget

    def elapsed(self):
        return time.perf_counter() - self.t0

    def over_budget(self, what):
        if self.elapsed() > self.budget:
            self.note(f"skipped {what}: past the {self.budget:.0f} s budget")
            return True
        return False

    def note(self, msg):
        print(f"[note] {msg}", flush=True)
        self.data["notes"].append(msg)

    def error(self, section, exc):
        msg = f"{section}: {type(exc).__name__}: {exc}"
        print(f"[ERROR] {msg}", flush=True)
        traceback.print_exc(limit=4)
        self.data["errors"].append({"section": section, "error": msg[:2000]})
        self.save()

    def row(self, **kw):
        self.data["results"].append(kw)
        t = kw.get("time_s")
        extra = "".join(f" {k}={v}" for k, v in kw.items()
                        if k not in ("section", "name", "L", "time_s") and v is not None)
        print(f"[{kw.get('section')}] L={kw.get('L')} {kw.get('name')}: "
              f"{'-' if t is None else f'{t * 1e3:.3f} ms'}{extra}", flush=True)
        self.save()

    def save(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def timeit(f, *args, reps, target_s=1.5):
    """Median wall time of f(*args) after a warm-up call (compile + first run excluded).

    Fewer repetitions when one call is long (about target_s of timed work; a single timed
    call when one call alone takes longer than target_s).
    """
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = time.perf_counter() - t
    n = max(1 if one > target_s else 2, min(reps, int(target_s / max(one, 1e-6))))
    times = [one]
    for _ in range(n - 1):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times), first


def visible_pairs(T, L, q_offset):
    """sum over queries i < T of min(L, q_offset + i + 1): causal (query, key) pairs."""
    a = q_offset + 1
    n_short = max(0, min(T, L - a))  # queries that see fewer than L keys
    return n_short * a + n_short * (n_short - 1) // 2 + (T - n_short) * L


def rand_inputs(key, T, L, H, D, dtype):
    kq, kw, kk = jax.random.split(key, 3)
    q = jax.random.normal(kq, (T, H, D), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (T, H), jnp.float32) * (H * D) ** -0.5
    k = jax.random.normal(kk, (L, D), jnp.float32).astype(dtype)
    return q, w, k


def max_err(out, ref):
    """(max abs error over entries finite in ref, max |ref|, masks agree, any NaN)."""
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    fin = jnp.isfinite(ref)
    err = jnp.max(jnp.where(fin, jnp.abs(out - ref), 0.0))
    scale = jnp.max(jnp.where(fin, jnp.abs(ref), 0.0))
    masks = jnp.all(jnp.isfinite(out) == fin)
    return float(err), float(scale), bool(masks), bool(jnp.any(jnp.isnan(out)))


class Kernels:
    """The three kernels for one backend and config set (bench-local dispatch)."""

    def __init__(self, backend, index_cfg=None, gather_cfg=None, sparse_cfg=None):
        self.backend = backend
        self.interpret = backend == "interpret"
        self.index_cfg = index_cfg or IndexScoresConfig()
        self.gather_cfg = gather_cfg or GatheredScoresConfig()
        self.sparse_cfg = sparse_cfg or SparseAttentionConfig()

    def scores(self, q, w, k, q_offset, key_block_size=1):
        if self.backend == "xla":
            return index_scores_reference(q, w, k, q_offset=q_offset,
                                          key_block_size=key_block_size)
        return index_scores_pallas(q, w, k, q_offset, key_block_size=key_block_size,
                                   config=self.index_cfg, interpret=self.interpret)

    def gathered(self, q, w, k, bt, q_offset, block_size):
        if self.backend == "xla":
            return gathered_index_scores_reference(q, w, k, bt, block_size=block_size,
                                                   q_offset=q_offset)
        return gathered_index_scores_pallas(q, w, k, bt, q_offset, block_size=block_size,
                                            config=self.gather_cfg,
                                            interpret=self.interpret)

    def sparse(self, q, k, v, idx):
        if self.backend == "xla":
            return sparse_attention_reference(q, k, v, idx)
        return sparse_attention_pallas(q, k, v, idx, config=self.sparse_cfg,
                                       interpret=self.interpret)


# --------------------------------------------------------------------------- pipelines

def topk_or_minus1(scores, top_k):
    if scores.shape[1] < top_k:
        scores = jnp.pad(scores, ((0, 0), (0, top_k - scores.shape[1])),
                         constant_values=-jnp.inf)
    vals, idx = lax.top_k(scores, top_k)
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32), vals


def pooled_keys(k, B):
    """Mean of each key block of B tokens (the last, partial block over its real tokens)."""
    L, D = k.shape
    nb = -(-L // B)
    kp = jnp.pad(k.astype(jnp.float32), ((0, nb * B - L), (0, 0))).reshape(nb, B, D)
    counts = jnp.clip(L - B * jnp.arange(nb), 1, B).astype(jnp.float32)
    return (kp.sum(axis=1) / counts[:, None]).astype(k.dtype)


def candidate_blocks(coarse, q_offset, *, B, query_tile, n_cand):
    """Per tile of query_tile queries: the n_cand best visible blocks -> i32[n_tiles, n_cand].

    A block's tile score is its best coarse score over the tile's queries. The sink block
    0 and the blocks holding the tile's own queries and the block before them are always
    kept (score +inf when visible). -1 where fewer blocks are visible.
    """
    Tc, nb = coarse.shape
    n_tiles = Tc // query_tile
    tile_scores = coarse.reshape(n_tiles, query_tile, nb).max(axis=1)
    first = q_offset + query_tile * jnp.arange(n_tiles)[:, None]
    last = first + query_tile - 1
    blk = jnp.arange(nb)[None, :]
    forced = (blk == 0) | ((blk >= first // B - 1) & (blk <= last // B))
    tile_scores = jnp.where(forced & (blk * B <= last), jnp.inf, tile_scores)
    ids, _ = topk_or_minus1(tile_scores, n_cand)
    return ids


def make_flat(kern, top_k, chunk, scores_only=False):
    """Whole-sequence flat selection (prefill in query chunks) -> i32[T, top_k]."""

    def run(q, w, k):
        T = q.shape[0]
        n = T // chunk
        qs = q.reshape(n, chunk, *q.shape[1:])
        ws = w.reshape(n, chunk, w.shape[1])
        offs = chunk * jnp.arange(n, dtype=jnp.int32)

        def one(args):
            qc, wc, off = args
            s = kern.scores(qc, wc, k, off)
            if scores_only:
                return jnp.max(s, axis=1)  # keeps the scores live without a top-k
            return topk_or_minus1(s, top_k)[0]

        return lax.map(one, (qs, ws, offs))

    return jax.jit(run)


def make_hierarchical(kern, top_k, chunk, *, B, query_tile, n_cand):
    """Whole-sequence hierarchical selection -> i32[T, top_k] (token ids, -1 = none)."""

    def run(q, w, k):
        T = q.shape[0]
        n = T // chunk
        pooled = pooled_keys(k, B)  # once per sequence
        nc = min(n_cand, pooled.shape[0])
        qs = q.reshape(n, chunk, *q.shape[1:])
        ws = w.reshape(n, chunk, w.shape[1])
        offs = chunk * jnp.arange(n, dtype=jnp.int32)

        def one(args):
            qc, wc, off = args
            coarse = kern.scores(qc, wc, pooled, off, key_block_size=B)
            bt = candidate_blocks(coarse, off, B=B, query_tile=query_tile, n_cand=nc)
            fine = kern.gathered(qc, wc, k, bt, off, B)  # [chunk, nc * B]
            cols, _ = topk_or_minus1(fine, top_k)
            tile = (jnp.arange(chunk) // query_tile)[:, None]
            safe = jnp.maximum(cols, 0)
            tokens = bt[tile, safe // B] * B + safe % B
            return jnp.where(cols >= 0, tokens, -1)

        return lax.map(one, (qs, ws, offs))

    return jax.jit(run)


def random_selection(key, T, K, L):
    """i32[T, K]: K random earlier-or-same tokens per query, -1 beyond the t + 1 visible."""
    t = jnp.arange(T)[:, None]
    u = jax.random.uniform(key, (T, K))
    idx = jnp.minimum((u * (t + 1)).astype(jnp.int32), L - 1)
    return jnp.where(jnp.arange(K)[None, :] <= t, idx, -1)
