"""The one dispatch point for dosa's kernels.

backend: None = best for the platform ("pallas" on GPU, "xla" elsewhere), or one of
"xla" (plain jnp reference), "pallas" (compiled Pallas kernel), "interpret" (the Pallas
kernel run by the Pallas interpreter; CPU tests). `indexer` and `model` call kernels only
through the functions here.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.gathered_index_scores import (
    gathered_index_scores_pallas,
    gathered_index_scores_reference,
)
from pallas_kernels.index_scores import index_scores_pallas, index_scores_reference
from pallas_kernels.sparse_attention import (
    sparse_attention_masked,
    sparse_attention_pallas,
    sparse_attention_reference,
)

BACKENDS = ("xla", "pallas", "interpret")


def resolve_backend(backend=None):
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    return backend


def _interpret(backend):
    """The kernels' `interpret` argument for a resolved non-xla backend."""
    return backend == "interpret"


def index_scores(q, w, k, *, q_offset=0, key_block_size=1, causal=True, backend=None):
    """q [T, H_I, d_I], w [T, H_I], k [L, d_I] -> f32[T, L] (-inf where key j > q_offset + i).

    q_offset may be a traced int32 scalar (chunked prefill). Coarse scoring on block
    summaries: key_block_size=B makes key j stand for tokens [j*B, (j+1)*B), visible iff
    j*B <= q_offset + i; causal=False masks nothing. See pallas_kernels.index_scores.
    """
    backend = resolve_backend(backend)
    if backend == "xla":
        return index_scores_reference(q, w, k, q_offset=q_offset,
                                      key_block_size=key_block_size, causal=causal)
    return index_scores_pallas(q, w, k, q_offset, key_block_size=key_block_size,
                               causal=causal, interpret=_interpret(backend))


def gathered_index_scores(q, w, k, block_table, *, block_size, q_offset=0, backend=None):
    """Fine-stage scores through a block table; see gathered_index_scores_reference.

    The Pallas backends need a power-of-two block_size.
    """
    backend = resolve_backend(backend)
    if backend == "xla":
        return gathered_index_scores_reference(
            q, w, k, block_table, block_size=block_size, q_offset=q_offset)
    return gathered_index_scores_pallas(q, w, k, block_table, q_offset,
                                        block_size=block_size,
                                        interpret=_interpret(backend))


# The xla backend attends through a mask of the selection (sparse_attention_masked) when it
# keeps at least this share of the keys: dense-ordered reads then cost less than a gather.
MASKED_MIN_SHARE = 1 / 4  # measured: a win at 2K and 4K with top_k 1024, a loss at 8K


# The xla backend attends XLA_ATTENTION_ROWS queries at a time (fewer, a power of two, where
# its per-query temporaries would pass XLA_ATTENTION_BYTES): whole-prefill-chunk temporaries
# were the largest buffers of a sparse prefill step (1024 queries x 256 gathered tokens:
# 128 MiB of K and V rows at 64K, more than the streaming selection's scores), and chunks
# are faster on CPU too (docs/design.md, "Query steps on the xla path").
XLA_ATTENTION_ROWS = 256
XLA_ATTENTION_BYTES = 32 << 20


def sparse_attention(q, k, v, indices, *, scale=None, backend=None):
    """q [T, H, D], k [L, H_kv, D], v [L, H_kv, Dv], indices i32[T, K] -> [T, H, Dv]."""
    backend = resolve_backend(backend)
    if backend == "xla":
        T, H = q.shape[:2]
        (L, H_kv, D), Dv = k.shape, v.shape[-1]
        if indices.shape[1] >= MASKED_MIN_SHARE * L:
            attend, row_bytes = sparse_attention_masked, 4 * L * (3 * H + 1)
        else:
            attend, row_bytes = sparse_attention_reference, 4 * indices.shape[1] * (
                H_kv * (D + Dv) + 2 * H)
        rows = rows_within(XLA_ATTENTION_BYTES, row_bytes, XLA_ATTENTION_ROWS)
        return map_query_rows(lambda _, qc, ic: attend(qc, k, v, ic, scale=scale), rows,
                              (q, indices), fill=(0, -1))
    return sparse_attention_pallas(q, k, v, indices, scale=scale,
                                   interpret=_interpret(backend))


def rows_within(budget_bytes, row_bytes, most, least=1):
    """Rows per chunk: the largest power of two whose temporaries (row_bytes each) fit
    budget_bytes, within [least, most]."""
    fit = max(1, budget_bytes // max(row_bytes, 1))
    return max(least, min(most, 1 << (fit.bit_length() - 1)))


def map_query_rows(fn, rows, arrays, fill=None):
    """fn(first_row, *chunks) over chunks of `rows` rows of `arrays` (a lax.map: one chunk's
    temporaries alive at a time), outputs (any pytree of [rows, ...] arrays) put back
    together -> [T, ...]. The last chunk is padded with `fill` (one value per array, default
    0) and its padded rows dropped; first_row: i32, the chunk's first row. rows >= T: one
    call, no padding."""
    T = arrays[0].shape[0]
    if rows >= T:
        return fn(jnp.int32(0), *arrays)
    n = -(-T // rows)
    fill = (0,) * len(arrays) if fill is None else fill
    padded = [jnp.pad(a, [(0, n * rows - T)] + [(0, 0)] * (a.ndim - 1), constant_values=f)
              .reshape(n, rows, *a.shape[1:]) for a, f in zip(arrays, fill)]
    out = jax.lax.map(lambda xs: fn(xs[0], *xs[1:]), (rows * jnp.arange(n, dtype=jnp.int32),
                                                       *padded))
    return jax.tree.map(lambda o: o.reshape(n * rows, *o.shape[2:])[:T], out)
