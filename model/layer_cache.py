"""A stack's cache (LayerCache) and one layer's view of it (LayerView).

The model's cache is a list over the stacks of model.layer_stack, each a LayerCache whose
arrays carry a leading layer axis ([layers of the stack, rows, ...]; serving's decode slots
add a batch axis before it). A layer's code reads and writes its own rows through a
LayerView (the stack and the layer's index, traced inside the scan): reads are that
layer's arrays (a dynamic slice), writes land in the stack in place (a dynamic update at
the layer's index and the written rows), so a scan over the stack carries the whole cache
and copies no layer's rows. Measured on this CPU (8 layers x 32768 rows x 64): a one-row
write and a 256-row read per layer cost 0.19 ms this way, 21 ms as separate per-layer
arrays, whose dynamic_update_slice followed by a read made XLA copy each whole layer.
"""

import jax
import jax.numpy as jnp

from indexer.block_summaries import SUMMARY_LAYOUT, BlockSummaryCache


@jax.tree_util.register_pytree_with_keys_class
class LayerCache:
    """One stack's cache: named arrays with a leading layer axis, read as attributes
    (cache.k, cache.k_index). A pytree (jit, donation, tree.map, shardings); pure updates
    return a new one.

    pages: None, or (a paged decode step's view, model.paged_cache.PageMap) where the
    stack's per-token kv rows are read: then its kv fields hold only the step's new rows,
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
            raise AttributeError(f"this cache has no {name!r}; it holds "
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
        """Whether the layers cache indexer keys (False on shared layers)."""
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
            raise ValueError(f"LayerCache.replace: unknown fields {unknown}; this cache holds "
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


class LayerView:
    """Layer `index` of a stack's LayerCache, as that layer's code reads and writes it:
    `view.name` / read(name) is the layer's array; write_rows, put and update return a view
    over the updated stack (immutable, like LayerCache). Not a pytree: it lives inside one
    layer's trace; `stack` is what the scan carries."""

    __slots__ = ("stack", "index")

    def __init__(self, stack, index):
        object.__setattr__(self, "stack", stack)
        object.__setattr__(self, "index", index)

    def __getattr__(self, name):
        if name in ("stack", "index"):
            raise AttributeError(name)
        if name not in self.stack.fields:
            raise AttributeError(f"this layer's cache has no {name!r}; it holds "
                                 f"{sorted(self.stack.fields)}")
        return self.read(name)

    def __setattr__(self, name, value):
        raise AttributeError("LayerView is immutable: use write_rows(), put() or update()")

    @property
    def names(self):
        return self.stack.names

    @property
    def pages(self):
        return self.stack.pages

    @property
    def has_index(self):
        return self.stack.has_index

    def read(self, name):
        """The layer's array of field `name`."""
        return jax.lax.dynamic_index_in_dim(self.stack.fields[name], self.index, keepdims=False)

    @property
    def summaries(self):
        """The layer's block summaries (BlockSummaryCache), or None."""
        if not self.has_index:
            return None
        return BlockSummaryCache(**{name: self.read(name) for name in SUMMARY_LAYOUT})

    def with_stack(self, **arrays):
        """The view over the stack with these whole stacked arrays replaced."""
        return LayerView(self.stack.replace(**arrays), self.index)

    def write_rows(self, name, rows, start):
        """Rows [start, start + len(rows)) of the layer's field `name` replaced by `rows`."""
        stacked = self.stack.fields[name]
        zero = jnp.zeros((), jnp.int32)
        at = (jnp.asarray(self.index, jnp.int32), jnp.asarray(start, jnp.int32),
              *(zero,) * (stacked.ndim - 2))
        return self.with_stack(**{name: jax.lax.dynamic_update_slice(
            stacked, rows.astype(stacked.dtype)[None], at)})

    def put(self, **arrays):
        """The layer's whole arrays replaced (small fields: DeepSeek-V4's state rings)."""
        out = {}
        for name, value in arrays.items():
            stacked = self.stack.fields[name]
            out[name] = jax.lax.dynamic_update_index_in_dim(
                stacked, value.astype(stacked.dtype), self.index, 0)
        return self.with_stack(**out)

    def update(self, name, fn):
        """The stack's array of `name` replaced by fn(stacked array, index): an in-place
        scatter into the layer's rows (block summaries, compressed entries)."""
        return self.with_stack(**{name: fn(self.stack.fields[name], self.index)})

    def update_summaries(self, fn, prefix=""):
        """The stack's block summaries (fields prefix + SUMMARY_LAYOUT's names) replaced by
        fn(stacked BlockSummaryCache, index) -> BlockSummaryCache."""
        stacked = BlockSummaryCache(**{n: self.stack.fields[prefix + n] for n in SUMMARY_LAYOUT})
        new = fn(stacked, self.index)
        return self.with_stack(**{prefix + n: v for n, v in new._asdict().items()})
