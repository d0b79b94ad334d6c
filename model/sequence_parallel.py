"""Sequence-parallel sparse attention: the hook a sparse layer takes when a mesh splits the
sequence (model.runner.ModelRunner(model, mesh=...) with mesh "sequence" > 1).

Layout: the KV cache is split along positions over the "sequence" axis (shard s owns
positions [s * C / S, (s + 1) * C / S)); indexer keys and block summaries are replicated
(written from the chunk's all-gathered new keys, so every shard scores every earlier
token). Per sparse layer, two shard_maps over the mesh:
  1. `select`: each sequence shard selects the top_k tokens of its own queries (any
     selection kind, over the replicated indexer keys), in zigzag order for causal balance
     (shard s takes query pieces s and 2S - 1 - s of the chunk, whole query tiles of the
     kind: indexer.selection), then the indices are all-gathered (T x top_k int32); a
     shared layer (indexer_types) skips this and reuses its full layer's indices;
  2. `sparse_attention`, distributed: every shard computes, for all T queries of the chunk,
     softmax partials over the selected tokens *it owns* (a pmax of the row maxima, then
     psums of the exp-sums and the weighted values): the KV rows never move, only
     T x H x (Dv + 1) partials do.
Heads stay split over "tensor" throughout (query head h reads kv head h // (H / H_kv), so
contiguous head shards line up with contiguous kv-head shards).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from indexer.selection import selection_kind
from model.attention import select_tokens
from model.cache import field_spec
from model.sharding import shard_map as _shard_map


def query_split(T, shards, tile=1):
    """How a chunk of T queries is split for selection -> (kind, piece length).

    "zigzag": 2 * shards pieces, shard s takes pieces s and 2 * shards - 1 - s;
    "contiguous": shard s takes piece s; "replicated": every shard selects all T (decode,
    or chunks too small to split). Pieces are whole multiples of `tile` (the hierarchical
    selector's query tile), so each query ranks the same candidates as on one device.
    """
    if shards > 1:
        for kind, n in (("zigzag", 2 * shards), ("contiguous", shards)):
            if T % n == 0 and (T // n) % tile == 0:
                return kind, T // n
    return "replicated", T


def partial_attention(q, k_local, v_local, indices, base, *, scale=None):
    """Unnormalised softmax pieces over the selected tokens one shard owns.

    q: [T, H, D]; k_local: [C_s, H_kv, D], v_local: [C_s, H_kv, Dv], the shard's cache
    rows (positions base .. base + C_s - 1); indices: i32[T, K] global positions (-1 =
    none). -> logits f32[T, H_kv, H / H_kv, K] (-inf where the token is not owned or not
    selected) and the gathered values f32[T, K, H_kv, Dv].
    """
    T, H, D = q.shape
    C_s, H_kv, _ = k_local.shape
    scale = D**-0.5 if scale is None else scale
    local = indices - base
    owned = (indices >= 0) & (local >= 0) & (local < C_s)
    safe = jnp.where(owned, local, 0)
    qg = q.reshape(T, H_kv, H // H_kv, D)
    logits = jnp.einsum("tgrd,tkgd->tgrk", qg, k_local[safe],
                        preferred_element_type=jnp.float32) * scale
    logits = jnp.where(owned[:, None, None, :], logits, -jnp.inf)
    return logits, v_local[safe].astype(jnp.float32)


def combine_partials(logits, values, axis, *, scatter=False):
    """Softmax over the union of every shard's tokens: a pmax of the row maxima, then sums
    over the axis. logits f32[T, G, R, K], values f32[T, K, G, Dv] -> f32[T, G * R, Dv]
    (0 where a row has no token anywhere); scatter=True: a reduce-scatter instead of a psum,
    each shard keeping its contiguous T / shards rows (half the traffic of a psum)."""
    row_max = jax.lax.pmax(jnp.max(logits, axis=-1, keepdims=True), axis)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - row_max)
    if scatter:
        def reduce(x):
            return jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
    else:
        def reduce(x):
            return jax.lax.psum(x, axis)
    denom = reduce(jnp.sum(p, axis=-1, keepdims=True))
    out = reduce(jnp.einsum("tgrk,tkgd->tgrd", p, values))
    out = out / jnp.where(denom > 0, denom, 1.0)
    T, G, R, Dv = out.shape
    return out.reshape(T, G * R, Dv)


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Run-time setting passed to Transformer.__call__ (`parallel=`): the mesh and the
    names of its sequence and tensor axes. Hashable (a static jit argument)."""

    mesh: Mesh
    sequence_axis: str = "sequence"
    tensor_axis: str = "tensor"

    @property
    def shards(self):
        return int(self.mesh.shape[self.sequence_axis])

    def replicate(self, x):
        """x whole on every device (the chunk's new indexer keys [T, d_I]: the key cache
        and block summaries are replicated, so each shard appends them locally)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P()))

    def write_rows(self, view, rows, start):
        """A chunk's cache rows written into the sequence-split cache: each shard stores the
        rows that fall in its positions, at the layer of `view` (a model.layer_cache
        LayerView over the stack), in place (a plain dynamic_update_slice on a split axis
        would make GSPMD gather the whole cache first).

        rows: {name: [T, ...]} the chunk's rows of per-token fields split as model.cache
        says, at positions start..start+T-1 -> the updated view."""
        seq = self.sequence_axis
        names = tuple(rows)

        def body(start, layer, *arrays):
            local, new = arrays[:len(names)], arrays[len(names):]
            out = []
            for cache_rows, new_rows in zip(local, new):
                C_s = cache_rows.shape[1]
                pos = start + jnp.arange(new_rows.shape[0]) - jax.lax.axis_index(seq) * C_s
                pos = jnp.where((pos >= 0) & (pos < C_s), pos, C_s)  # C_s: dropped
                out.append(cache_rows.at[layer, pos].set(new_rows.astype(cache_rows.dtype),
                                                         mode="drop"))
            return tuple(out)

        specs = tuple(field_spec(n) for n in names)
        # the chunk's rows, whole
        new_specs = tuple(P(None, *field_spec(n, stacked=False)[1:]) for n in names)
        fn = _shard_map(body, mesh=self.mesh, in_specs=(P(), P(), *specs, *new_specs),
                        out_specs=specs, check_vma=False)
        out = fn(jnp.asarray(start, jnp.int32), jnp.asarray(view.index, jnp.int32),
                 *(view.stack.fields[n] for n in names), *(rows[n] for n in names))
        return view.with_stack(**dict(zip(names, out)))

    def select(self, config, layer, q_index, w_index, k_index, *, q_offset, summaries=None,
               screen=None):
        """Layer `layer`'s selection with the chunk's queries split over the sequence axis
        -> i32[T, top_k], whole on every shard and equal to model.attention.select_tokens.

        q_index [T, H_I, d_I], w_index [T, H_I]; k_index [kv_len, d_I] and summaries
        replicated; q_offset: position of query 0; screen: the layer's coarse screen
        (indexer.ScreenParams, replicated) or None."""
        T = q_index.shape[0]
        S, seq = self.shards, self.sequence_axis
        kind = selection_kind(config.layer_indexer(layer))
        tile = kind.query_tile(config.layer_settings(layer), T)
        split, piece = query_split(T, S, tile)
        groups = tuple(g for g in (summaries, screen) if g is not None)

        def body(q_index, w_index, k_index, start, *rest):
            rest = list(rest)
            sums = type(summaries)(*[rest.pop(0) for _ in summaries]) if summaries is not None \
                else None
            scr = type(screen)(*rest) if screen is not None else None
            s = jax.lax.axis_index(seq)

            def select(offset, n):
                rows = (jax.lax.dynamic_slice_in_dim(q_index, offset, n, 0),
                        jax.lax.dynamic_slice_in_dim(w_index, offset, n, 0))
                return select_tokens(config, layer, *rows, k_index, q_offset=start + offset,
                                     summaries=sums, screen=scr)

            if split == "replicated":
                return select(0, T)
            if split == "contiguous":
                return jax.lax.all_gather(select(s * piece, piece), seq, tiled=True)
            mine = jnp.concatenate([select(s * piece, piece),
                                    select((2 * S - 1 - s) * piece, piece)])
            got = jax.lax.all_gather(mine, seq)  # [S, 2 * piece, K]: pieces s, 2S-1-s
            K = got.shape[-1]
            return jnp.concatenate([got[:, :piece].reshape(-1, K),
                                    got[::-1, piece:].reshape(-1, K)])

        args = (q_index, w_index, k_index, jnp.asarray(q_offset, jnp.int32))
        for group in groups:
            args += tuple(group)
        # check_vma=False: the selection may run Pallas kernels (GPU), which carry no
        # varying-manual-axes annotations.
        fn = _shard_map(body, mesh=self.mesh, in_specs=(P(),) * len(args), out_specs=P(),
                        check_vma=False)
        return fn(*args)

    def sparse_attention(self, q, fields, read, indices, *, scale=None):
        """Sparse attention over a sequence-sharded cache: each shard's softmax partials over
        the selected tokens it owns, combined (the KV rows never move).

        q: [T, H, D] (RoPE applied); fields: {name: [C, ...]} the layer's per-token cache
        fields, split over the sequence axis, with this chunk already written; read: the
        attention kind's rows -> (keys [C_s, H_kv, D], values [C_s, H_kv, Dv]) (applied to
        each shard's own rows); indices: i32[T, top_k] global positions, replicated (from
        `select`). -> out [T, H, Dv] in q's dtype, equal to the single-device path."""
        T = q.shape[0]
        S, seq, ten = self.shards, self.sequence_axis, self.tensor_axis
        names = tuple(fields)
        # Split output rows (reduce-scatter) when they divide: activations are split too.
        scatter = T % S == 0

        def body(q, indices, *local):
            k_local, v_local = read(dict(zip(names, local)))
            base = jax.lax.axis_index(seq) * k_local.shape[0]
            logits, values = partial_attention(q, k_local, v_local, indices, base, scale=scale)
            return combine_partials(logits, values, seq, scatter=scatter).astype(q.dtype)

        fn = _shard_map(body, mesh=self.mesh,
                        in_specs=(P(None, ten, None), P(),
                                  *(field_spec(n, stacked=False) for n in names)),
                        out_specs=P(seq if scatter else None, ten, None), check_vma=False)
        return fn(q, indices, *(fields[n] for n in names))
