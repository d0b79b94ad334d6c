"""A layer's cache, owned here: which arrays it holds (`field`), their creation, the writes of a
step, prefix copies in and out (serving's prefix/index cache), sharding specs and bytes per
token. The runner, the engine, the prefix cache and the sharding rules go through these
functions and name no field.

Every field is a model.cache_field.CacheField: its part ("kv": main attention; "index": the
lightning indexer's keys and their block summaries), its unit (positions per row: one row
per token, one per key block of `block_size` positions, or one per whatever ModelConfig
field it names), trailing shape and dtype from the ModelConfig, logical axes
(model.sharding) and the value an empty row holds. The index fields are INDEX_FIELDS here;
the kv fields are each attention kind's own (model.attention_kinds); `field(name)` finds
either. A layer holds the kv fields of its attention kind, and the index fields unless its
indexer_types entry is "shared" (it runs no indexer). Adding a field is one entry here or in
its attention kind's, plus the module that writes it (the kind's `project` returns its rows
by name).
"""

import jax
import jax.numpy as jnp
import numpy as np

from indexer.block_summaries import SUMMARY_LAYOUT, BlockSummaryCache
from indexer.block_summaries import append as append_summaries
from model.attention_kinds import ATTENTION_KINDS, attention_kind
from model.cache_field import PARTS, CacheField, model_dtype
from model.sharding import check_capacity, logical_to_spec, named

BLOCK = "hierarchical.block_size"  # a row per key block (CacheField.positions_per_row)

INDEX_FIELDS = {
    "k_index": CacheField("index", lambda c: (c.index_dim,), model_dtype,
                          ("index_cache_seq", "index_dim")),
    **{name: CacheField("index", (lambda c: (c.index_dim,)) if per_dim else (lambda c: ()),
                        lambda c, dtype=dtype: dtype,
                        ("blocks", "index_dim") if per_dim else ("blocks",), fill, BLOCK)
       for name, (dtype, per_dim, fill) in SUMMARY_LAYOUT.items()},
}


def field(name):
    """The CacheField `name`: an index field, or a kv field of an attention kind."""
    if name in INDEX_FIELDS:
        return INDEX_FIELDS[name]
    for kind in ATTENTION_KINDS.values():
        if name in kind.cache_fields:
            return kind.cache_fields[name]
    raise KeyError(f"no cache field {name!r}")


def layer_fields(config, layer):
    """The fields layer `layer` holds: its attention kind's, then the index fields unless
    the layer is shared or its kind indexes itself (DeepSeek-V4)."""
    kind = attention_kind(config, layer)
    skip = config.layer_is_shared(layer) or kind.self_indexed
    return (*kind.cache_fields, *(() if skip else INDEX_FIELDS))


@jax.tree_util.register_pytree_with_keys_class
class LayerCache:
    """One layer's cache: named arrays (`field`), read as attributes (cache.k, cache.k_index).
    A pytree (jit, donation, tree.map, shardings); pure updates return a new one.

    pages: None, or (a paged decode step's view, model.paged_cache.PageMap) where the
    layer's per-token kv rows are read: then its kv fields hold only the step's new rows,
    and token_rows / the sparse read go through the map."""

    __slots__ = ("fields", "pages")

    def __init__(self, fields, pages=None):
        object.__setattr__(self, "fields", dict(fields))
        object.__setattr__(self, "pages", pages)

    def __getattr__(self, name):
        if name in ("fields", "pages"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(f"this layer's cache has no {name!r}; it holds "
                                 f"{sorted(self.fields)}") from None

    def __setattr__(self, name, value):
        raise AttributeError("LayerCache is immutable: use replace()")

    def __repr__(self):
        return f"LayerCache({self.fields!r})"

    @property
    def names(self):
        return tuple(self.fields)

    @property
    def has_index(self):
        """Whether the layer caches indexer keys (False on a shared layer)."""
        return "k_index" in self.fields

    @property
    def summaries(self):
        """The block summaries of the indexer keys (indexer.BlockSummaryCache), or None."""
        if not self.has_index:
            return None
        return BlockSummaryCache(**{name: self.fields[name] for name in SUMMARY_LAYOUT})

    def replace(self, **arrays):
        unknown = sorted(set(arrays) - set(self.fields))
        if unknown:
            raise ValueError(f"LayerCache.replace: unknown fields {unknown}; this layer holds "
                             f"{sorted(self.fields)}")
        return LayerCache({**self.fields, **arrays}, self.pages)

    def tree_flatten_with_keys(self):
        children = [(jax.tree_util.DictKey(k), v) for k, v in self.fields.items()]
        if self.pages is not None:
            children.append((jax.tree_util.GetAttrKey("pages"), self.pages))
        return children, (tuple(self.fields), self.pages is not None)

    @classmethod
    def tree_unflatten(cls, aux, values):
        names, paged = aux
        values = list(values)
        return cls(dict(zip(names, values)), values[len(names)] if paged else None)


def _rows(name, length, config):
    """Rows of field `name` that hold the first `length` positions."""
    return field(name).rows(length, config)


# ------------------------------------------------------------------ creation

def init_cache(config, capacity):
    """Empty caches for every layer, `capacity` positions long."""
    out = []
    for layer in range(config.n_layers):
        fields = {}
        for name in layer_fields(config, layer):
            f = field(name)
            fields[name] = jnp.full((_rows(name, capacity, config), *f.shape(config)), f.fill,
                                    jnp.dtype(f.dtype(config)))
        out.append(LayerCache(fields))
    return out


def cache_capacity(cache, config=None, *, batched=False):
    """Positions a cache (a list of LayerCache; batched: a leading slot axis) holds: the
    rows of its first field that grows with them, times that field's positions per row
    (capacities are multiples of each: model.buckets). config: needed when that field's
    unit is a config value (DeepSeek-V4's compressed entries)."""
    axis = 1 if batched else 0
    for layer in cache:
        for name in layer.names:
            f = field(name)
            if f.is_state:
                continue
            if config is None and not isinstance(f.positions_per_row, int):
                raise ValueError(f"cache_capacity: field {name!r} holds a row per "
                                 f"{f.positions_per_row} positions: pass the config")
            return int(layer.fields[name].shape[axis]) * f.stride(config)
    raise ValueError("cache_capacity: no layer of this cache holds positions")


def part_copy(cache, part):
    """A copy of the fields of one part ("kv" or "index") of every layer: what outlives the
    cache (e.g. the indexer keys a comparison reselects over, without the kv bytes)."""
    return [LayerCache({name: jnp.copy(array) for name, array in layer.fields.items()
                        if field(name).part == part}) for layer in cache]


def token_rows(cache, names, kv_len=None):
    """{name: rows [0, kv_len)} of a layer's per-token fields `names` (None: every row)."""
    if cache.pages is not None:
        return cache.pages.rows(cache.fields, names, kv_len)
    return {name: cache.fields[name][:kv_len] for name in names}


# ------------------------------------------------------------------ writes of a step

def write_rows(array, new, start):
    """array with rows [start, start + len(new)) replaced by `new` (in array's dtype)."""
    return jax.lax.dynamic_update_slice_in_dim(array, new.astype(array.dtype), start, 0)


def overlay_rows(array, new, start):
    """write_rows as a select over every row: an expression XLA fuses into what reads it
    (a gathered view stays a gather of the pages) rather than an update of a copy."""
    offset = jnp.arange(array.shape[0]) - start
    inside = (offset >= 0) & (offset < new.shape[0])
    rows = jnp.take(new.astype(array.dtype), jnp.clip(offset, 0, new.shape[0] - 1), axis=0)
    return jnp.where(inside.reshape(-1, *(1,) * (array.ndim - 1)), rows, array)


def write_index(cache, k_index, start, *, block_size, n_valid=None):
    """The layer's indexer keys k_index [T, d_I] written at start.., and their block
    summaries extended (only the first n_valid rows are real tokens: default T)."""
    if cache.pages is None:
        keys = write_rows(cache.k_index, k_index, start)
    else:  # a paged view: a select, so its readers gather from the pages themselves
        keys = overlay_rows(cache.k_index, k_index, start)
    summaries = append_summaries(cache.summaries, k_index, start, block_size=block_size,
                                 n_valid=n_valid, keys=keys)
    return cache.replace(k_index=keys, **summaries._asdict())


# ------------------------------------------------------------------ sharding

def field_spec(name, *, batched=False):
    """The PartitionSpec of field `name` (model.sharding's rules over its logical axes)."""
    return logical_to_spec((("batch",) if batched else ()) + field(name).axes)


def cache_specs(cache, *, batched=False):
    """PartitionSpecs of a list of LayerCache (batched: a leading "batch" axis), by the fields'
    logical axes through model.sharding's rules."""
    return [LayerCache({name: field_spec(name, batched=batched) for name in c.names})
            for c in cache]


def cache_shapes(config, capacity, mesh):
    """ShapeDtypeStructs of init_sharded_cache's result, shardings included (to compile
    steps without allocating a cache)."""
    shapes = jax.eval_shape(lambda: init_cache(config, capacity))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, named(mesh, cache_specs(shapes)))


def init_sharded_cache(config, capacity, mesh):
    """Empty caches created directly on their shardings: no device ever holds the whole KV
    cache. ValueError unless the mesh's sequence axis divides capacity."""
    check_capacity(mesh, capacity)
    shapes = jax.eval_shape(lambda: init_cache(config, capacity))
    return jax.jit(lambda: init_cache(config, capacity),
                   out_shardings=named(mesh, cache_specs(shapes)))()


# ------------------------------------------------------------------ bytes

def layer_bytes_per_token(config, layer=0):
    """Bytes per cached token of layer `layer`: {"kv", "index_keys", "block_summaries"}
    (a field of several positions per row divided by them; a state field, the same bytes
    at every length, counts nothing: layer_state_bytes)."""
    out = {"kv": 0, "index_keys": 0, "block_summaries": 0.0}
    for name in layer_fields(config, layer):
        f = field(name)
        if f.is_state:
            continue
        row = _row_bytes(f, config)
        group = "kv" if f.part == "kv" else "block_summaries" if f.axes[0] == "blocks" \
            else "index_keys"
        out[group] += row if f.per_token else row / f.stride(config)
    return out


def layer_state_bytes(config, layer=0):
    """Bytes of layer `layer`'s state fields (DeepSeek-V4's window and compressor tails): a
    constant per request, whatever its length."""
    total = 0
    for name in layer_fields(config, layer):
        f = field(name)
        if f.is_state:
            total += f.rows(0, config) * _row_bytes(f, config)
    return total


def _row_bytes(f, config):
    return int(np.prod(f.shape(config), dtype=np.int64)) * jnp.dtype(f.dtype(config)).itemsize


def bytes_per_token(config):
    """layer_bytes_per_token summed over the layers."""
    per = [layer_bytes_per_token(config, i) for i in range(config.n_layers)]
    return {k: sum(p[k] for p in per) for k in per[0]}


# ------------------------------------------------------------------ prefix copies

def state_fields(config):
    """The names of the state fields (fixed rows: DeepSeek-V4's rings) any layer holds."""
    return sorted({name for layer in range(config.n_layers)
                   for name in layer_fields(config, layer) if field(name).is_state})


def take_prefix(cache, length, config):
    """The rows of the first `length` positions (static) of every field that grows with
    the positions: a list over layers of {field: array} (a "prefix"; jit-able with length
    and config static). State fields (DeepSeek-V4's rings) hold the state at the cache's
    end, not at `length`: they are not part of a prefix (take_state)."""
    return [{name: array[:_rows(name, length, config)] for name, array in c.fields.items()
             if not field(name).is_state} for c in cache]


def take_state(cache):
    """The state fields of every layer (DeepSeek-V4's window and compressor tails), as they
    are at the cache's end: a list over layers of {field: array} (jit-able)."""
    return [{name: array for name, array in c.fields.items() if field(name).is_state}
            for c in cache]


def put_state(cache, state):
    """`cache` with its state fields replaced by `state` (take_state's form; jit-able)."""
    return [c.replace(**{name: value.astype(c.fields[name].dtype) for name, value in s.items()})
            for c, s in zip(cache, state)]


def state_bytes(state):
    """Bytes of a host state (take_state's form)."""
    return sum(int(a.nbytes) for layer in state for a in layer.values())


def put_prefix(cache, prefix):
    """`cache` with `prefix`'s rows written at its start (jit-able)."""
    return [c.replace(**{name: c.fields[name].at[:rows.shape[0]].set(rows.astype(
        c.fields[name].dtype)) for name, rows in p.items()}) for c, p in zip(cache, prefix)]


def slice_prefix(prefix, start, stop, config):
    """Positions [start, stop) of a host prefix (both multiples of every field's positions
    per row) as copies."""
    for name in prefix[0]:
        stride = field(name).stride(config)
        if start % stride or stop % stride:
            raise ValueError(f"slice_prefix: positions [{start}, {stop}) must be multiples of "
                             f"{stride}, the positions per row of cache field {name!r}")
    out = []
    for p in prefix:
        out.append({name: np.array(rows[_rows(name, start, config):_rows(name, stop, config)])
                    for name, rows in p.items()})
    return out


def join_prefix(pieces):
    """Consecutive host prefixes joined into one."""
    return [{name: np.concatenate([piece[layer][name] for piece in pieces])
             for name in pieces[0][layer]} for layer in range(len(pieces[0]))]


def pad_prefix(prefix, length, config):
    """A host prefix padded to `length` positions, padding rows holding each field's empty
    value (padded positions are overwritten by the prefill before anything reads them)."""
    out = []
    for p in prefix:
        layer = {}
        for name, rows in p.items():
            pad = [(0, 0)] * rows.ndim
            pad[0] = (0, _rows(name, length, config) - rows.shape[0])
            layer[name] = np.pad(rows, pad, constant_values=field(name).fill)
        out.append(layer)
    return out


def prefix_bytes(prefix):
    """{part: bytes} of a host prefix (PARTS)."""
    out = dict.fromkeys(PARTS, 0)
    for p in prefix:
        for name, rows in p.items():
            out[field(name).part] += rows.nbytes
    return out


def prefix_specs(prefix, sequence_shards):
    """PartitionSpecs to place a host prefix as the cache it goes into: per-token fields by
    their logical axes when the sequence shards divide their rows, the rest replicated."""
    def spec(name, rows):
        f = field(name)
        if f.per_token and rows.shape[0] % sequence_shards == 0:
            return logical_to_spec(f.axes)
        return logical_to_spec((None,) * rows.ndim)

    return [{name: spec(name, rows) for name, rows in p.items()} for p in prefix]
