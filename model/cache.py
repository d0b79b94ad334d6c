"""A layer's cache, owned here: which arrays it holds (FIELDS), their creation, the writes of a
step, prefix copies in and out (serving's prefix/index cache), sharding specs and bytes per
token. The runner, the engine, the prefix cache and the sharding rules go through these
functions and name no field.

Every field is one entry of FIELDS: its part ("kv": main attention; "index": the lightning
indexer's keys and their block summaries), the attention kind it belongs to ("gqa": K and
V; "mla": the latent; None: any), its unit (one row per position, or one per key block of
`block_size` positions), trailing shape and dtype from the ModelConfig, logical axes
(model.sharding) and the value an empty row holds. A layer holds the kv fields of its
attention kind, and the index fields unless its indexer_types entry is "shared" (it runs no
indexer). Adding a field is one entry here, plus the module that writes it (the attention
kind's `project` returns its rows by name).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from indexer.block_summaries import SUMMARY_LAYOUT, BlockSummaryCache, num_blocks
from indexer.block_summaries import append as append_summaries
from model.sharding import check_capacity, logical_to_spec, named

PARTS = ("kv", "index")


@dataclasses.dataclass(frozen=True)
class CacheField:
    """part: "kv" | "index"; unit: "token" | "block"; shape: config -> trailing dims;
    dtype: config -> dtype name; axes: logical axes of every dim, rows first; fill: an
    empty row's value; attention: the attention kind that holds it (None: every kind)."""

    part: str
    unit: str
    shape: Callable
    dtype: Callable
    axes: tuple
    fill: float = 0.0
    attention: str | None = None


def _model_dtype(config):
    return config.dtype


FIELDS = {
    "k": CacheField("kv", "token", lambda c: (c.n_kv_heads, c.head_dim), _model_dtype,
                    ("cache_seq", "kv_heads", "head_dim"), attention="gqa"),
    "v": CacheField("kv", "token", lambda c: (c.n_kv_heads, c.head_dim), _model_dtype,
                    ("cache_seq", "kv_heads", "head_dim"), attention="gqa"),
    # MLA: [c | k_rope] per token, one head shared by every attention head (model/mla.py).
    "kv_latent": CacheField("kv", "token", lambda c: (c.mla.latent_dim,), _model_dtype,
                            ("cache_seq", "latent"), attention="mla"),
    "k_index": CacheField("index", "token", lambda c: (c.index_dim,), _model_dtype,
                          ("index_cache_seq", "index_dim")),
    **{name: CacheField("index", "block",
                        (lambda c: (c.index_dim,)) if per_dim else (lambda c: ()),
                        lambda c, dtype=dtype: dtype,
                        ("blocks", "index_dim") if per_dim else ("blocks",), fill)
       for name, (dtype, per_dim, fill) in SUMMARY_LAYOUT.items()},
}


def attention_kind(config):
    """"mla" or "gqa": the attention kind of the model's layers."""
    return "gqa" if config.mla is None else "mla"


def layer_fields(config, layer):
    """The fields layer `layer` holds, in FIELDS order."""
    shared, kind = config.layer_is_shared(layer), attention_kind(config)
    return tuple(name for name, f in FIELDS.items()
                 if f.attention in (None, kind) and not (shared and f.part == "index"))


@jax.tree_util.register_pytree_with_keys_class
class LayerCache:
    """One layer's cache: named arrays (FIELDS), read as attributes (cache.k, cache.k_index).
    A pytree (jit, donation, tree.map, shardings); pure updates return a new one."""

    __slots__ = ("fields",)

    def __init__(self, fields):
        object.__setattr__(self, "fields", dict(fields))

    def __getattr__(self, name):
        if name == "fields":  # not set yet (copy, unpickling)
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
        return LayerCache({**self.fields, **arrays})

    def tree_flatten_with_keys(self):
        return ([(jax.tree_util.DictKey(k), v) for k, v in self.fields.items()],
                tuple(self.fields))

    @classmethod
    def tree_unflatten(cls, names, values):
        return cls(dict(zip(names, values)))


def _rows(name, length, block_size):
    """Rows of field `name` that hold the first `length` positions."""
    return length if FIELDS[name].unit == "token" else num_blocks(length, block_size)


# ------------------------------------------------------------------ creation

def init_cache(config, capacity):
    """Empty caches for every layer, `capacity` positions long."""
    B = config.hierarchical.block_size
    out = []
    for layer in range(config.n_layers):
        fields = {}
        for name in layer_fields(config, layer):
            f = FIELDS[name]
            fields[name] = jnp.full((_rows(name, capacity, B), *f.shape(config)), f.fill,
                                    jnp.dtype(f.dtype(config)))
        out.append(LayerCache(fields))
    return out


def cache_capacity(cache, *, batched=False):
    """Positions a cache (a list of LayerCache; batched: a leading slot axis) holds."""
    name = next(n for n in cache[0].names if FIELDS[n].unit == "token")
    return int(cache[0].fields[name].shape[1 if batched else 0])


def token_rows(cache, names, kv_len=None):
    """{name: rows [0, kv_len)} of a layer's per-token fields `names` (None: every row)."""
    return {name: cache.fields[name][:kv_len] for name in names}


# ------------------------------------------------------------------ writes of a step

def write_rows(array, new, start):
    """array with rows [start, start + len(new)) replaced by `new` (in array's dtype)."""
    return jax.lax.dynamic_update_slice_in_dim(array, new.astype(array.dtype), start, 0)


def write_index(cache, k_index, start, *, block_size, n_valid=None):
    """The layer's indexer keys k_index [T, d_I] written at start.., and their block
    summaries extended (only the first n_valid rows are real tokens: default T)."""
    keys = write_rows(cache.k_index, k_index, start)
    summaries = append_summaries(cache.summaries, k_index, start, block_size=block_size,
                                 n_valid=n_valid, keys=keys)
    return cache.replace(k_index=keys, **summaries._asdict())


# ------------------------------------------------------------------ sharding

def field_spec(name, *, batched=False):
    """The PartitionSpec of field `name` (model.sharding's rules over its logical axes)."""
    return logical_to_spec((("batch",) if batched else ()) + FIELDS[name].axes)


def cache_specs(cache, *, batched=False):
    """PartitionSpecs of a list of LayerCache (batched: a leading "batch" axis), by FIELDS'
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
    (block-unit fields divided by block_size)."""
    out = {"kv": 0, "index_keys": 0, "block_summaries": 0.0}
    B = config.hierarchical.block_size
    for name in layer_fields(config, layer):
        f = FIELDS[name]
        row = int(np.prod(f.shape(config), dtype=np.int64)) * jnp.dtype(f.dtype(config)).itemsize
        group = "kv" if f.part == "kv" else "index_keys" if f.unit == "token" else \
            "block_summaries"
        out[group] += row if f.unit == "token" else row / B
    return out


def bytes_per_token(config):
    """layer_bytes_per_token summed over the layers."""
    per = [layer_bytes_per_token(config, i) for i in range(config.n_layers)]
    return {k: sum(p[k] for p in per) for k in per[0]}


# ------------------------------------------------------------------ prefix copies

def take_prefix(cache, length, block_size):
    """The rows of the first `length` positions (static) of every field: a list over layers
    of {field: array} (a "prefix"; jit-able)."""
    return [{name: array[:_rows(name, length, block_size)] for name, array in c.fields.items()}
            for c in cache]


def put_prefix(cache, prefix):
    """`cache` with `prefix`'s rows written at its start (jit-able)."""
    return [c.replace(**{name: c.fields[name].at[:rows.shape[0]].set(rows.astype(
        c.fields[name].dtype)) for name, rows in p.items()}) for c, p in zip(cache, prefix)]


def slice_prefix(prefix, start, stop, block_size):
    """Positions [start, stop) of a host prefix (both multiples of block_size) as copies."""
    if start % block_size or stop % block_size:
        raise ValueError(f"slice_prefix: positions [{start}, {stop}) must be multiples of the "
                         f"block size {block_size}")
    out = []
    for p in prefix:
        out.append({name: np.array(rows[_rows(name, start, block_size):
                                        _rows(name, stop, block_size)])
                    for name, rows in p.items()})
    return out


def join_prefix(pieces):
    """Consecutive host prefixes joined into one."""
    return [{name: np.concatenate([piece[layer][name] for piece in pieces])
             for name in pieces[0][layer]} for layer in range(len(pieces[0]))]


def pad_prefix(prefix, length, block_size):
    """A host prefix padded to `length` positions, padding rows holding each field's empty
    value (padded positions are overwritten by the prefill before anything reads them)."""
    out = []
    for p in prefix:
        layer = {}
        for name, rows in p.items():
            pad = [(0, 0)] * rows.ndim
            pad[0] = (0, _rows(name, length, block_size) - rows.shape[0])
            layer[name] = np.pad(rows, pad, constant_values=FIELDS[name].fill)
        out.append(layer)
    return out


def prefix_bytes(prefix):
    """{part: bytes} of a host prefix (PARTS)."""
    out = dict.fromkeys(PARTS, 0)
    for p in prefix:
        for name, rows in p.items():
            out[FIELDS[name].part] += rows.nbytes
    return out


def prefix_specs(prefix, sequence_shards):
    """PartitionSpecs to place a host prefix as the cache it goes into: per-token fields by
    their logical axes when the sequence shards divide their rows, the rest replicated."""
    def spec(name, rows):
        f = FIELDS[name]
        if f.unit == "token" and rows.shape[0] % sequence_shards == 0:
            return logical_to_spec(f.axes)
        return logical_to_spec((None,) * rows.ndim)

    return [{name: spec(name, rows) for name, rows in p.items()} for p in prefix]
