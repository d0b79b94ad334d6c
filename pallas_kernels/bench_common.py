"""Helpers of the kernel microbenchmark (`python -m pallas_kernels.bench`): the report that
collects rows and rewrites its JSON, timing, FLOP counts, error measures, and the random
input cases of each kernel (`Case`: inputs, Pallas kernel, reference, FLOPs).
"""

import dataclasses
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.gathered_index_scores import (
    gathered_index_scores_pallas,
    gathered_index_scores_reference,
)
from pallas_kernels.index_scores import index_scores_pallas, index_scores_reference
from pallas_kernels.sparse_attention import sparse_attention_pallas, sparse_attention_reference


class Report:
    """Collects rows, correctness checks, notes and errors; rewrites `path` (JSON) after each.

    data keys: args (without `hidden_args`), smoke, env, correctness, tuning, results,
    errors, notes, elapsed_s, and what main adds (tuned, chosen_configs). Nothing
    machine-specific beyond the env section (device kind, versions) goes in: no paths.
    """

    def __init__(self, path, args, *, hidden_args=("out",)):
        self.path = path
        self.t0 = time.perf_counter()
        self.budget = args.budget
        self.data = {"args": {k: (sorted(v) if isinstance(v, set) else v)
                              for k, v in vars(args).items() if k not in hidden_args},
                     "smoke": bool(getattr(args, "smoke", False)), "env": {},
                     "correctness": [], "tuning": [], "results": [], "errors": [], "notes": []}

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

    def check(self, name, out, ref, rtol):
        """Records out vs ref: ok iff the -inf masks agree, no NaN, and the max abs error
        over ref's finite entries is <= rtol * max(max |ref|, 1)."""
        err, scale, masks, nan = max_err(out, ref)
        ok = masks and not nan and err <= rtol * max(scale, 1.0)
        self.data["correctness"].append(dict(name=name, max_abs_err=err, max_abs_ref=scale,
                                             masks_match=masks, nan=nan, ok=ok))
        print(f"[correctness] {name}: max abs err {err:.3e} (max |ref| {scale:.3e}), "
              f"masks {'match' if masks else 'DIFFER'}, {'NaN!' if nan else 'no NaN'}"
              f" -> {'OK' if ok else 'FAIL'}", flush=True)
        return ok

    def save(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def env_info():
    """Device kind and versions (what a result needs to be read; no host names or paths)."""
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "device_kind": dev.device_kind, "python": sys.version.split()[0]}


def timeit(f, *args, reps, target_s=1.5):
    """(median wall time of f(*args), seconds of the first call) -> floats.

    The first call (compile + run) and a second (warm-up) are not in the median. Fewer
    repetitions when one call is long (about target_s of timed work; a single timed call
    when one call alone takes longer than target_s).
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


def tflops(flops, seconds):
    """TFLOP/s to 3 significant digits (CPU smoke rates are far below 0.1)."""
    return float(f"{flops / seconds / 1e12:.3g}")


def visible_pairs(T, L, q_offset):
    """sum over queries i < T of min(L, q_offset + i + 1): causal (query, key) pairs."""
    a = q_offset + 1
    n_short = max(0, min(T, L - a))  # queries that see fewer than L keys
    return n_short * a + n_short * (n_short - 1) // 2 + (T - n_short) * L


# The input builders are jitted with static shapes: one compile per shape set instead of one
# per eager op (which dominates a CPU smoke run).

@functools.partial(jax.jit, static_argnums=(1, 2))
def normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def rand_inputs(key, T, L, H, D, dtype):
    """Indexer inputs q [T, H, D], w f32[T, H] (scaled so scores stay O(1)), k [L, D]."""
    kq, kw, kk = jax.random.split(key, 3)
    w = jax.random.normal(kw, (T, H), jnp.float32) * (H * D) ** -0.5
    return normal(kq, (T, H, D), dtype), w, normal(kk, (L, D), dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_selection(key, T, K, L, q_offset=0):
    """i32[T, K]: K random earlier-or-same tokens (< L) per query, query i at position
    t = q_offset + i; -1 in the slots beyond the t + 1 tokens it sees."""
    t = q_offset + jnp.arange(T)[:, None]
    u = jax.random.uniform(key, (T, K))
    idx = jnp.minimum((u * (t + 1)).astype(jnp.int32), L - 1)
    return jnp.where(jnp.arange(K)[None, :] <= t, idx, -1)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def random_block_table(key, n_tiles, n_cand, n_blocks, first_query, query_tile, block_size):
    """i32[n_tiles, n_cand]: per tile of query_tile queries (the first at position
    first_query), random blocks all visible to the tile's first query, sorted;
    first_query=None: random ids in [-1, n_blocks) (invalid and future blocks too)."""
    if first_query is None:
        return jax.random.randint(key, (n_tiles, n_cand), -1, n_blocks)
    seen = (first_query + query_tile * jnp.arange(n_tiles))[:, None] // block_size + 1
    return jnp.sort(jax.random.randint(key, (n_tiles, n_cand), 0, seen), axis=1)


@jax.jit
def _err_stats(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    fin = jnp.isfinite(ref)
    return (jnp.max(jnp.where(fin, jnp.abs(out - ref), 0.0)),
            jnp.max(jnp.where(fin, jnp.abs(ref), 0.0)),
            jnp.all(jnp.isfinite(out) == fin), jnp.any(jnp.isnan(out)))


def max_err(out, ref):
    """(max abs error over entries finite in ref, max |ref|, masks agree, any NaN in out)."""
    out, ref = jnp.asarray(out), jnp.asarray(ref)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} != reference shape {ref.shape}")
    err, scale, masks, nan = _err_stats(out, ref)
    return float(err), float(scale), bool(masks), bool(nan)


# --------------------------------------------------------------------------- cases
# Each builder: the last T queries of an L-token sequence; `args` carries the dimensions
# (heads, dim, block, query_tile, cand_factor, top_k, attn_heads, attn_kv_heads, attn_dim).

@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call: its inputs, the Pallas kernel over them (keyword arguments config,
    interpret, poison), its reference, the FLOPs it is credited with, and the bytes per
    query row the reference materialises (which bounds the rows it is timed on)."""

    kernel: str
    arrays: tuple
    pallas: Callable
    reference: Callable
    flops: float
    ref_bytes_per_query: int

    def jitted(self, config, interpret, poison=None):
        return jax.jit(functools.partial(self.pallas, config=config, interpret=interpret,
                                         poison=poison))


def scores_case(key, T, L, args, *, dtype=jnp.bfloat16, q_offset=None, key_block_size=1):
    """index_scores of T queries (by default the last T of L tokens) against L keys."""
    off = L - T if q_offset is None else q_offset
    H, D = args.heads, args.dim
    q, w, k = rand_inputs(key, T, L, H, D, dtype)
    pallas = functools.partial(_scores_pallas, q_offset=off, key_block_size=key_block_size)
    ref = functools.partial(index_scores_reference, q_offset=off, key_block_size=key_block_size)
    return Case("index_scores", (q, w, k), pallas, ref,
                2.0 * H * D * visible_pairs(T, L, off), H * L * 4)


def _scores_pallas(q, w, k, *, q_offset, key_block_size, config, interpret, poison):
    return index_scores_pallas(q, w, k, q_offset, key_block_size=key_block_size,
                               config=config, interpret=interpret, poison=poison)


def gathered_case(key, T, L, args, *, visible_only=True):
    """gathered_index_scores of the last T of L tokens; per tile of query_tile queries a
    block table of n_cand = cand_factor * top_k / block blocks, sorted, all visible to the
    tile's first query (visible_only: every scored pair is real work), else random ids in
    [-1, n_blocks) (invalid and future blocks too: the correctness case)."""
    H, D, B, qt = args.heads, args.dim, args.block, args.query_tile
    off, nb = L - T, -(-L // B)
    n_cand = min(nb, max(1, args.cand_factor * args.top_k // B))
    kx, kt = jax.random.split(key)
    q, w, k = rand_inputs(kx, T, L, H, D, jnp.bfloat16)
    bt = random_block_table(kt, T // qt, n_cand, nb, off if visible_only else None, qt, B)

    def pallas(q, w, k, bt, *, config, interpret, poison):
        return gathered_index_scores_pallas(q, w, k, bt, off, block_size=B, config=config,
                                            interpret=interpret, poison=poison)

    ref = functools.partial(gathered_index_scores_reference, block_size=B, q_offset=off)
    return Case("gathered_index_scores", (q, w, k, bt), pallas, ref,
                2.0 * H * D * T * n_cand * B, H * n_cand * B * 4)


def sparse_case(key, T, L, args, *, heads=None, kv_heads=None, top_k=None):
    """sparse_attention of the last T of L tokens over top_k random earlier tokens each."""
    Hq, Hkv = heads or args.attn_heads, kv_heads or args.attn_kv_heads
    Dh, K = args.attn_dim, min(top_k or args.top_k, L)
    kq, kk, kv, ki = jax.random.split(key, 4)
    q = normal(kq, (T, Hq, Dh), jnp.bfloat16)
    k, v = normal(kk, (L, Hkv, Dh), jnp.bfloat16), normal(kv, (L, Hkv, Dh), jnp.bfloat16)
    idx = random_selection(ki, T, K, L, L - T)
    return Case("sparse_attention", (q, k, v, idx), sparse_attention_pallas,
                sparse_attention_reference, 4.0 * Hq * Dh * visible_pairs(T, K, L - T),
                K * Hkv * Dh * 2 * 2 + Hq * K * 4 * 2)
