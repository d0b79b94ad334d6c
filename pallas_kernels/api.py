"""The one dispatch point for dosa's kernels: a table of ops, each listing its
implementations and their fallback order per platform (in the style of tokamax's
ops/*/api.py).

Every op has a plain XLA implementation, "xla" (jnp / lax: the reference every other
implementation must match, and the one every platform can run). The others:
- "pallas": dosa's Triton-backend Pallas kernel (GPU: A100 and Hopper);
- "interpret": the same kernel run by the Pallas interpreter (CPU tests; never a default);
- "tokamax_triton", "tokamax_mosaic": tokamax's kernels (grouped matmul; GPU, from the
  `cuda12` extra); "xla_tiles": the grouped matmul as a plain-XLA loop over row tiles;
  "xla_blocks": sparse attention over the union of key blocks a tile of queries selected
  (pallas_kernels.sparse_attention_blocks; by name only: on SmolLM2's 8K selections it
  measured 0.93-1.16x the time of the per-query gathers of "xla", docs/results.md).
`backend=` / `implementation=` None takes the first implementation of the op's order for
the platform being compiled for that is installed and accepts the arguments (an
implementation raises NotImplementedError at trace time for arguments it does not take,
and the next one is tried); a name runs that implementation or raises.

The platform is the one being compiled for (`target_platform`): a GPU target compiled on a
CPU machine (experiments.benchmarks.gpu_compile: a topology device as the default device,
or an abstract GPU mesh) resolves to the GPU order, not to `jax.default_backend()`.
`indexer` and `model` call kernels only through the functions here.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from pallas_kernels import tokamax_ops
from pallas_kernels.gathered_index_scores import (
    gathered_index_scores_pallas,
    gathered_index_scores_reference,
)
from pallas_kernels.grouped_matmul import (
    grouped_matmul_pallas,
    grouped_matmul_reference,
    grouped_matmul_tiles,
)
from pallas_kernels.index_scores import index_scores_pallas, index_scores_reference
from pallas_kernels.sparse_attention import (
    sparse_attention_masked,
    sparse_attention_pallas,
    sparse_attention_reference,
)
from pallas_kernels.sparse_attention_blocks import DEFAULT_TILES, sparse_attention_blocks

ANY_PLATFORM = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Implementation:
    """run: the op's arguments -> its result; platforms: those it compiles for;
    installed: whether the packages it needs are importable (checked without importing)."""

    run: Callable
    platforms: tuple[str, ...] = ANY_PLATFORM
    installed: Callable[[], bool] = lambda: True


@dataclasses.dataclass(frozen=True)
class Op:
    """implementations by name ("xla" is the reference); order: the fallback order per
    platform, "default" for any platform not named."""

    name: str
    implementations: Mapping[str, Implementation]
    order: Mapping[str, tuple[str, ...]]

    def candidates(self, implementation=None, platform=None):
        """The implementations to try, in order, for this platform (default: the target)."""
        platform = platform or target_platform()
        implementation = implementation or (_CHOSEN.get() or {}).get(self.name)
        if implementation is None:
            names = self.order.get(platform, self.order["default"])
            return [n for n in names if self._runs(n, platform)]
        if implementation not in self.implementations:
            raise ValueError(f"{self.name}: implementation (backend) must be None or one of "
                             f"{sorted(self.implementations)}, got {implementation!r}")
        impl = self.implementations[implementation]
        if platform not in impl.platforms:
            raise ValueError(f"{self.name}: implementation {implementation!r} compiles for "
                             f"{list(impl.platforms)}, not for {platform!r} (the platform "
                             f"being compiled for)")
        if not impl.installed():
            raise ValueError(f"{self.name}: implementation {implementation!r} needs packages "
                             f"that are not installed (pip install 'dosa[cuda12]')")
        return [implementation]

    def _runs(self, name, platform):
        impl = self.implementations[name]
        return platform in impl.platforms and impl.installed()

    def __call__(self, *args, implementation=None, **kwargs):
        names = self.candidates(implementation)
        for i, name in enumerate(names):
            try:
                return self.implementations[name].run(*args, **kwargs)
            except NotImplementedError:
                if i == len(names) - 1:
                    raise


def target_platform():
    """"cpu", "gpu" or "tpu": the platform the enclosing computation is compiled for. An
    abstract mesh with a device (jax.sharding.use_abstract_mesh, or jax.set_mesh over a
    GPU topology's devices) names it; else the default device (jax.default_device, e.g. a
    topology device from jax.experimental.topologies); else jax.default_backend()."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is None:
        device = jax.config.jax_default_device
    platform = device if isinstance(device, str) or device is None else device.platform
    platform = platform or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


_CHOSEN = contextvars.ContextVar("dosa_kernel_implementations", default=None)


@contextlib.contextmanager
def use_implementations(**chosen):
    """Inside: calls of op `name` that name no implementation run chosen[name] (e.g.
    use_implementations(index_scores="xla"): what the compile check counts FLOPs with).
    Read while tracing, and JAX caches traces by argument, not by this choice: call
    jax.clear_caches() before tracing again what was traced under other choices."""
    for name, implementation in chosen.items():
        OPS[name].candidates(implementation)  # a clear error for a bad name, here
    token = _CHOSEN.set({**(_CHOSEN.get() or {}), **chosen})
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def resolve(op, implementation=None):
    """The implementation `op` (a name in OPS) would try first here."""
    return OPS[op].candidates(implementation)[0]


def _interpreted(kernel):
    return lambda *args, **kwargs: kernel(*args, interpret=True, **kwargs)


def _kernel_implementations(reference, kernel):
    """xla / pallas / interpret of an op with a reference and one Pallas kernel."""
    return {"xla": Implementation(reference),
            "pallas": Implementation(kernel, platforms=("gpu",)),
            "interpret": Implementation(_interpreted(kernel))}


KERNEL_ORDER = {"gpu": ("pallas", "xla"), "default": ("xla",)}


def _index_scores_pallas(q, w, k, *, q_offset, key_block_size, causal, interpret=False):
    return index_scores_pallas(q, w, k, q_offset, key_block_size=key_block_size,
                               causal=causal, interpret=interpret)


def _gathered_pallas(q, w, k, block_table, *, block_size, q_offset, interpret=False):
    return gathered_index_scores_pallas(q, w, k, block_table, q_offset,
                                        block_size=block_size, interpret=interpret)


def _tokamax(name):
    return Implementation(
        lambda *args, **kwargs: tokamax_ops.ragged_dot(name, *args, **kwargs),
        platforms=("gpu",), installed=lambda: tokamax_ops.installed(name))


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


def _sparse_attention_xla(q, k, v, indices, *, scale=None):
    """The reference's math a chunk of queries at a time (masked where that is cheaper)."""
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


def _sparse_attention_blocks(q, k, v, indices, *, scale=None, tiles=DEFAULT_TILES):
    """sparse_attention_blocks over tiles of tiles.rows queries."""
    return map_query_rows(
        lambda _, qc, ic: sparse_attention_blocks(qc, k, v, ic, scale=scale, tiles=tiles),
        tiles.rows, (q, indices), fill=(0, -1))


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


OPS = {op.name: op for op in (
    Op("index_scores",
       _kernel_implementations(index_scores_reference, _index_scores_pallas), KERNEL_ORDER),
    Op("gathered_index_scores",
       _kernel_implementations(gathered_index_scores_reference, _gathered_pallas),
       KERNEL_ORDER),
    Op("sparse_attention",
       {**_kernel_implementations(_sparse_attention_xla, sparse_attention_pallas),
        "xla_blocks": Implementation(_sparse_attention_blocks)},
       KERNEL_ORDER),
    # The MoE's expert product. XLA's GPU lowering of ragged_dot densifies (a [rows,
    # groups, K] operand: 112 GiB at DeepSeek-V3.2's sizes), so on GPU it comes last,
    # after a plain-XLA loop over row tiles; tokamax's Mosaic GPU kernel takes no 2-D FP8
    # scale blocks and passes those calls on.
    Op("grouped_matmul",
       {**_kernel_implementations(grouped_matmul_reference, grouped_matmul_pallas),
        "xla_tiles": Implementation(grouped_matmul_tiles),
        "tokamax_triton": _tokamax("tokamax_triton"),
        "tokamax_mosaic": _tokamax("tokamax_mosaic")},
       {"gpu": ("tokamax_triton", "tokamax_mosaic", "pallas", "xla_tiles", "xla"),
        "default": ("xla",)}),
)}


def index_scores(q, w, k, *, q_offset=0, key_block_size=1, causal=True, backend=None):
    """q [T, H_I, d_I], w [T, H_I], k [L, d_I] -> f32[T, L] (-inf where key j > q_offset + i).

    q_offset may be a traced int32 scalar (chunked prefill). Coarse scoring on block
    summaries: key_block_size=B makes key j stand for tokens [j*B, (j+1)*B), visible iff
    j*B <= q_offset + i; causal=False masks nothing. See pallas_kernels.index_scores.
    """
    return OPS["index_scores"](q, w, k, q_offset=q_offset, key_block_size=key_block_size,
                               causal=causal, implementation=backend)


def gathered_index_scores(q, w, k, block_table, *, block_size, q_offset=0, backend=None):
    """Fine-stage scores through a block table; see gathered_index_scores_reference.

    The Pallas implementations need a power-of-two block_size.
    """
    return OPS["gathered_index_scores"](q, w, k, block_table, block_size=block_size,
                                        q_offset=q_offset, implementation=backend)


def sparse_attention(q, k, v, indices, *, scale=None, backend=None):
    """q [T, H, D], k [L, H_kv, D], v [L, H_kv, Dv], indices i32[T, K] -> [T, H, Dv]."""
    return OPS["sparse_attention"](q, k, v, indices, scale=scale, implementation=backend)


def grouped_matmul(lhs, rhs, group_sizes, *, rhs_scale=None, scale_block=None,
                   out_dtype=None, stack_index=None, implementation=None):
    """lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes i32[G] (sum <= M) ->
    [M, N]: the rows of group g times rhs[g] (jax.lax.ragged_dot's contract; rows past the
    groups are zero). rhs_scale f32[G, ceil(K / scale_block[0]), ceil(N / scale_block[1])]:
    rhs is block-scaled (FP8 e4m3 as released), read as stored by the GPU kernels.
    stack_index (traced is fine): rhs and rhs_scale are a stack of layers' experts
    [S, G, ...] and layer stack_index is multiplied (the pallas kernel and the tile loop
    read it in place; tokamax's kernels pass such calls on)."""
    return OPS["grouped_matmul"](lhs, rhs, group_sizes, rhs_scale=rhs_scale,
                                 scale_block=scale_block, out_dtype=out_dtype,
                                 stack_index=stack_index, implementation=implementation)
