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

The cache is a list over the stacks of model.layer_stack: one LayerCache per stack, each
array with a leading layer axis ([layers of the stack, rows, ...]; model.layer_cache), so
a scan over the stack's layers reads and writes it in place. `layer_of` gives one layer's
arrays to code outside the model (shadow recall, evaluation).
"""

import jax
import jax.numpy as jnp
import numpy as np

from indexer.block_summaries import SUMMARY_LAYOUT
from indexer.block_summaries import append as append_summaries
from model.attention_kinds import ATTENTION_KINDS, attention_kind
from model.cache_field import PARTS, CacheField, model_dtype
from model.layer_cache import LayerCache, LayerView
from model.layer_stack import layer_plan
from model.sharding import check_capacity, logical_to_spec, named

__all__ = ["LayerCache", "LayerView"]  # re-exported: their home is model.layer_cache

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


def _rows(name, length, config):
    """Rows of field `name` that hold the first `length` positions."""
    return field(name).rows(length, config)


# ------------------------------------------------------------------ creation

def init_cache(config, capacity):
    """Empty caches for every stack of layers (model.layer_stack), `capacity` positions
    long: a list of LayerCache, each array [layers of the stack, rows, ...]."""
    out = []
    for layers in layer_plan(config).stacks:
        fields = {}
        for name in layer_fields(config, layers[0]):
            f = field(name)
            fields[name] = jnp.full((len(layers), _rows(name, capacity, config),
                                     *f.shape(config)), f.fill, jnp.dtype(f.dtype(config)))
        out.append(LayerCache(fields))
    return out


def layer_of(cache, config, layer):
    """Layer `layer`'s arrays of a cache (init_cache's form) as a LayerCache of its own
    (copies; for code outside the model: shadow recall, evaluation, tests)."""
    s, index = layer_plan(config).place[layer]
    return LayerCache({name: array[index] for name, array in cache[s].fields.items()})


def cache_capacity(cache, config=None, *, batched=False):
    """Positions a cache (init_cache's list of LayerCache; batched: a leading slot axis)
    holds: the rows of its first field that grows with them, times that field's positions
    per row (capacities are multiples of each: model.buckets). config: needed when that
    field's unit is a config value (DeepSeek-V4's compressed entries)."""
    axis = 2 if batched else 1
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
    """A copy of the fields of one part ("kv" or "index") of every stack: what outlives the
    cache (e.g. the indexer keys a comparison reselects over, without the kv bytes)."""
    return [LayerCache({name: jnp.copy(array) for name, array in layer.fields.items()
                        if field(name).part == part}) for layer in cache]


def token_rows(view, names, kv_len=None):
    """{name: rows [0, kv_len)} of a layer's per-token fields `names` (None: every row);
    view: the layer's LayerView."""
    if view.pages is not None:
        return view.pages.rows(view, names, kv_len)
    return {name: view.read(name)[:kv_len] for name in names}


# ------------------------------------------------------------------ writes of a step

def overlay_rows(array, new, start):
    """Rows [start, start + len(new)) of array replaced by `new`, as a select over every
    row: an expression XLA fuses into what reads it
    (a gathered view stays a gather of the pages) rather than an update of a copy."""
    offset = jnp.arange(array.shape[0]) - start
    inside = (offset >= 0) & (offset < new.shape[0])
    rows = jnp.take(new.astype(array.dtype), jnp.clip(offset, 0, new.shape[0] - 1), axis=0)
    return jnp.where(inside.reshape(-1, *(1,) * (array.ndim - 1)), rows, array)


def write_index(view, k_index, start, *, block_size, n_valid=None):
    """The layer's indexer keys k_index [T, d_I] written at start.., and their block
    summaries extended (only the first n_valid rows are real tokens: default T); view: the
    layer's LayerView -> the updated view."""
    if view.pages is None:
        view = view.write_rows("k_index", k_index, start)
    else:  # a paged view: a select, so its readers gather from the pages themselves
        view = view.put(k_index=overlay_rows(view.read("k_index"), k_index, start))
    keys = view.read("k_index")
    return view.update_summaries(lambda summaries, index: append_summaries(
        summaries, k_index, start, block_size=block_size, n_valid=n_valid, keys=keys,
        layer=index))


# ------------------------------------------------------------------ sharding

def field_spec(name, *, batched=False, stacked=True):
    """The PartitionSpec of field `name` (model.sharding's rules over its logical axes):
    with its stack's leading "layers" axis (stacked; False: one layer's array), after a
    "batch" axis when batched."""
    return logical_to_spec((("batch",) if batched else ()) + (("layers",) if stacked else ())
                           + field(name).axes)


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
    the positions: a list over stacks of {field: array [layers, rows, ...]} (a "prefix";
    jit-able with length and config static). State fields (DeepSeek-V4's rings) hold the
    state at the cache's end, not at `length`: they are not part of a prefix
    (take_state)."""
    return [{name: array[:, :_rows(name, length, config)] for name, array in c.fields.items()
             if not field(name).is_state} for c in cache]


def take_state(cache):
    """The state fields of every stack (DeepSeek-V4's window and compressor tails), as they
    are at the cache's end: a list over stacks of {field: array} (jit-able)."""
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
    return [c.replace(**{name: c.fields[name].at[:, :rows.shape[1]].set(rows.astype(
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
        out.append({name: np.array(rows[:, _rows(name, start, config):_rows(name, stop, config)])
                    for name, rows in p.items()})
    return out


def join_prefix(pieces):
    """Consecutive host prefixes joined into one."""
    return [{name: np.concatenate([piece[s][name] for piece in pieces], axis=1)
             for name in pieces[0][s]} for s in range(len(pieces[0]))]


def pad_prefix(prefix, length, config):
    """A host prefix padded to `length` positions, padding rows holding each field's empty
    value (padded positions are overwritten by the prefill before anything reads them)."""
    out = []
    for p in prefix:
        layer = {}
        for name, rows in p.items():
            pad = [(0, 0)] * rows.ndim
            pad[1] = (0, _rows(name, length, config) - rows.shape[1])
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
        if f.per_token and rows.shape[1] % sequence_shards == 0:
            return logical_to_spec(("layers",) + f.axes)
        return logical_to_spec((None,) * rows.ndim)

    return [{name: spec(name, rows) for name, rows in p.items()} for p in prefix]
