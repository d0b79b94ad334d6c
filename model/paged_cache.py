"""The paged form of model.cache: every field that grows with the positions kept in one pool
of pages per layer, shared by all running requests, and a block table per request naming
the pages that hold its positions [j P, (j + 1) P) (P = page_tokens, a multiple of every
field's positions per row). State fields (DeepSeek-V4's window and compressor rings) stay
per request: a row of the pool's state arrays per request slot, outside the pages.

Layout of a pool (a list over the stacks of model.layer_stack, each a model.cache.LayerCache
with the same field names as the stack's cache, every array after its leading layer axis):
a growing field is [layers, n_pages * rows_per_page, ...] (page p's rows are the p-th run
of rows_per_page = P / the field's positions per row); a state field is
[layers, n_slots + 1, ...] (the last slot is scratch: the idle rows of a decode batch
write there). Two pages are
reserved: SCRATCH (an idle batch row's table points only here: its writes land there and
nothing real reads it) and EMPTY (never written: holds every field's empty value; a block
table's unused entries point here, so a read past a request's pages sees an empty cache,
as a fresh contiguous cache would).

A decode step reads through the block table (`gather_view`: the request's pages as the
contiguous cache model.transformer reads, up to the step's key length) and writes back
only the rows the step wrote (`touched_rows`, `scatter_rows`): a page shared by several
requests (a cached prompt prefix) is never written. `write_pages` and `read_pages` move
whole pages between a contiguous cache (a prefill's) and the pool.
"""

import jax
import jax.numpy as jnp

from model.attention_kinds import attention_kind
from model.cache import LayerCache, field, init_cache, layer_fields
from model.layer_stack import layer_plan

SCRATCH, EMPTY = 0, 1
RESERVED_PAGES = 2


def check_page_tokens(config, page_tokens, capacity):
    """ValueError naming cache_block_tokens unless a page holds whole rows of every field
    and a whole number of pages makes `capacity` positions."""
    for layer in range(config.n_layers):
        for name in layer_fields(config, layer):
            f = field(name)
            if not f.is_state and page_tokens % f.stride(config):
                raise ValueError(f"cache_block_tokens ({page_tokens}) must be a multiple of "
                                 f"{f.stride(config)}, the positions per row of cache field "
                                 f"{name!r}")
    if capacity % page_tokens:
        raise ValueError(f"cache_block_tokens ({page_tokens}) must divide the cache capacity "
                         f"({capacity} positions: the power-of-two bucket of max_context)")


def rows_per_page(name, page_tokens, config):
    return page_tokens // field(name).stride(config)


def init_pool(config, n_pages, page_tokens, n_slots):
    """An empty pool: n_pages pages (RESERVED_PAGES of them reserved) and n_slots + 1 rows
    of state (the last one scratch)."""
    if n_pages <= RESERVED_PAGES:
        raise ValueError(f"a page pool needs more than {RESERVED_PAGES} pages (the scratch "
                         f"and the empty page), got {n_pages}")
    one = init_cache(config, page_tokens)  # one page of every field, empty
    out = []
    for stack in one:
        fields = {}
        for name, rows in stack.fields.items():
            if field(name).is_state:
                fields[name] = jnp.broadcast_to(rows[:, None], (rows.shape[0], n_slots + 1,
                                                                *rows.shape[1:]))
            else:
                fields[name] = jnp.tile(rows, (1, n_pages) + (1,) * (rows.ndim - 2))
        out.append(LayerCache(fields))
    return out


def page_bytes(config, page_tokens):
    """Bytes of one page over every layer (what a request's P positions hold)."""
    shapes = jax.eval_shape(lambda: init_cache(config, page_tokens))
    return sum(int(s.size) * s.dtype.itemsize for stack in shapes
               for name, s in stack.fields.items() if not field(name).is_state)


def _paged(array, rpp):
    """[layers, pages x rpp, ...] -> [layers, pages, rpp, ...]."""
    return array.reshape(array.shape[0], array.shape[1] // rpp, rpp, *array.shape[2:])


# ------------------------------------------------------------------ decode (per request, vmapped)

@jax.tree_util.register_pytree_node_class
class PageMap:
    """Where one request's per-token kv rows live in the pool during a decode step: the
    pool's arrays of those fields for a stack ({name: [layers, n_pages * P, ...]}), the
    physical row of each of the step's kv_len logical positions (row_map i32[kv_len]) and
    the step's position (its new rows are the view's own until written back). A sparse
    read gathers only the selected rows of the reading layer; a dense read (a dense layer)
    gathers them all."""

    def __init__(self, pool, row_map, position):
        self.pool, self.row_map, self.position = pool, row_map, position

    def tree_flatten(self):
        return (self.pool, self.row_map, self.position), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def rows(self, view, names, kv_len=None):
        """{name: rows [0, kv_len)} of the layer of `view` (model.layer_cache.LayerView,
        whose fields hold the step's new row [1, ...]) with that new row in place."""
        out = {}
        for name in names:
            rows = self.pool[name][view.index, self.row_map[:kv_len]]
            out[name] = jax.lax.dynamic_update_slice_in_dim(
                rows, view.read(name).astype(rows.dtype), self.position, 0)
        return out

    def selected(self, view, names, indices):
        """The rows the layer of `view` attends to in a one-token step: indices i32[1, K]
        (-1: none) -> ({name: rows [K, ...]}, local indices i32[1, K] into them)."""
        flat = indices[0]
        physical = self.row_map[jnp.clip(flat, 0, self.row_map.shape[0] - 1)]
        new = {name: view.read(name) for name in names}
        mine = (flat == self.position).reshape(-1, *(1,) * (new[names[0]].ndim - 1))
        out = {}
        for name in names:
            rows = self.pool[name][view.index, physical]
            out[name] = jnp.where(mine, new[name][0].astype(rows.dtype), rows)
        local = jnp.where(indices >= 0, jnp.arange(flat.shape[0]), -1)
        return out, local


def _row_map(table, kv_len, page_tokens):
    logical = jnp.arange(kv_len)
    return table[logical // page_tokens] * page_tokens + logical % page_tokens


def gather_view(pool, table, state, position, kv_len, page_tokens, config):
    """The cache of one request up to kv_len positions as model.transformer reads it (a list
    over stacks of LayerCache laid out as model.cache.init_cache(config, kv_len)) through
    its block table i32[max_pages], for a step at `position`; state: its state fields
    ({field: [layers, ...]} per stack). A DSA layer's per-token kv fields are not gathered:
    the view holds a row for the step's new token and a PageMap to read the rest
    (LayerCache.pages); the other fields are gathered."""
    n = -(-kv_len // page_tokens)
    out = []
    for layers, stack, own in zip(layer_plan(config).stacks, pool, state):
        fields, mapped = {}, {}
        direct = not attention_kind(config, layers[0]).self_indexed
        for name, array in stack.fields.items():
            f = field(name)
            if f.is_state:
                fields[name] = own[name]
            elif direct and f.part == "kv" and f.per_token:
                mapped[name] = array
                fields[name] = jnp.zeros((array.shape[0], 1, *array.shape[2:]), array.dtype)
            else:
                rpp = rows_per_page(name, page_tokens, config)
                rows = _paged(array, rpp)[:, table[:n]].reshape(array.shape[0], n * rpp,
                                                                 *array.shape[2:])
                fields[name] = rows[:, :f.rows(kv_len, config)]
        pages = None
        if mapped:
            pages = PageMap(mapped, _row_map(table, kv_len, page_tokens), position)
        out.append(LayerCache(fields, pages))
    return out


def touched_rows(view, position, config):
    """What a one-token step at `position` wrote into a view: the row holding `position` of
    every growing field ({field: [layers, ...]} per stack), and every state field whole."""
    out = []
    for stack in view:
        rows = {}
        for name, array in stack.fields.items():
            f = field(name)
            if f.is_state:
                rows[name] = array
            elif stack.pages is not None and name in stack.pages.pool:
                rows[name] = array[:, 0]
            else:
                rows[name] = jax.lax.dynamic_index_in_dim(array, position // f.stride(config),
                                                          axis=1, keepdims=False)
        out.append(rows)
    return out


def scatter_rows(pool, rows, tables, positions, slots, page_tokens, config):
    """The pool with a decode batch's touched rows (touched_rows, batched [B, layers, ...])
    written through the block tables i32[B, max_pages] at positions i32[B], and the
    batch's state fields at state rows slots i32[B]."""
    out = []
    for stack, new in zip(pool, rows):
        fields = {}
        for name, array in stack.fields.items():
            f = field(name)
            value = jnp.swapaxes(new[name], 0, 1).astype(array.dtype)  # [layers, B, ...]
            if f.is_state:
                fields[name] = array.at[:, slots].set(value)
                continue
            rpp = rows_per_page(name, page_tokens, config)
            row = positions // f.stride(config)
            page = jnp.take_along_axis(tables, (row // rpp)[:, None], axis=1)[:, 0]
            fields[name] = array.at[:, page * rpp + row % rpp].set(value)
        out.append(LayerCache(fields))
    return out


def slot_state(pool, slots):
    """The state fields of the requests in state rows slots i32[B] ({field: [B, layers,
    ...]} per stack: the batch axis first, as the step's vmap takes it)."""
    return [{name: jnp.swapaxes(array[:, slots], 0, 1) for name, array in stack.fields.items()
             if field(name).is_state} for stack in pool]


# ------------------------------------------------------------------ whole pages (prefill)

def write_pages(pool, cache, pages, slot, page_tokens, config):
    """The pool with page j of a contiguous cache (positions [j P, (j + 1) P)) written to pool
    page pages[j], for j < len(pages) (pages i32[n], static length; a page not to write
    goes to SCRATCH), and the cache's state fields into state row `slot`."""
    n = pages.shape[0]
    out = []
    for stack, src in zip(pool, cache):
        fields = {}
        for name, array in stack.fields.items():
            f = field(name)
            rows = src.fields[name].astype(array.dtype)
            if f.is_state:
                fields[name] = array.at[:, slot].set(rows)
                continue
            rpp = rows_per_page(name, page_tokens, config)
            fields[name] = _paged(array, rpp).at[:, pages].set(
                _paged(rows[:, :n * rpp], rpp)).reshape(array.shape)
        out.append(LayerCache(fields))
    return out


def read_pages(pool, pages, capacity, page_tokens, config):
    """A contiguous cache of `capacity` positions whose page j is pool page pages[j]
    (pages i32[capacity / P]: EMPTY where nothing is cached), state fields empty."""
    fresh = init_cache(config, capacity)
    out = []
    for stack, empty in zip(pool, fresh):
        fields = {}
        for name, array in stack.fields.items():
            if field(name).is_state:
                fields[name] = empty.fields[name]
                continue
            rpp = rows_per_page(name, page_tokens, config)
            fields[name] = _paged(array, rpp)[:, pages].reshape(array.shape[0], -1,
                                                                *array.shape[2:])
        out.append(LayerCache(fields))
    return out
