"""The engine over a paged cache (cache_layout: paged; model.paged_cache, serving.page_pool).

Every running request's cache is a block table into one pool of pages. A request is
admitted when the pages of its prompt + max_tokens fit (`fits`): a cached prompt prefix's
pages are taken by reference (held, never written), the rest are its own. Its prefill runs
as the Engine's, in a one-request contiguous workspace that starts with the hit pages read
from the pool (a device gather, no host copy); at its end the workspace's pages past the
hit are written into the request's own pages and its full prompt blocks are keyed for
later prompts (`cache_prompt`). Decode runs every running request in one batched step,
padded to a power-of-two batch (one compiled step per batch and key-length bucket), each
reading its pages through its block table.

Memory: the pool, plus one workspace of max_context positions (the prefill in progress;
the slot layout has the same one beside its slots). A failed decode step loses the pool
(it is donated to the step): its requests get the error, the pool and its cached
prefixes start empty, and the request being prefilled keeps its workspace and pages.
"""

import jax
import jax.numpy as jnp
import numpy as np

from model import cache as layer_cache
from model import paged_cache
from model.buckets import length_bucket
from model.paged_cache import EMPTY, RESERVED_PAGES, SCRATCH
from serving.engine import Engine, Prefill, Sampling
from serving.page_pool import PagePool

MIN_BATCH = 4


def batch_buckets(max_running):
    """The decode batch sizes compiled: powers of two from MIN_BATCH (or max_running, if
    smaller) up to the first one holding max_running."""
    sizes = [min(MIN_BATCH, max_running)]
    while sizes[-1] < max_running:
        sizes.append(sizes[-1] * 2)
    return sizes


class PagedEngine(Engine):
    def __init__(self, model, *, max_context, max_running, pool_pages, page_tokens,
                 prefill_chunk=None, cache_prefixes=True, shadow=None):
        """pool_pages: pages in the pool (two reserved: model.paged_cache); page_tokens: the
        positions of a page (cache_block_tokens); cache_prefixes: key full prompt blocks
        for later prompts (cache_size > 0)."""
        self.page_tokens, self.max_running = page_tokens, max_running
        self.pages = PagePool(pool_pages, page_tokens)
        self.cache_prefixes = cache_prefixes
        config = model.config
        layer_cache_capacity = length_bucket(max_context)
        paged_cache.check_page_tokens(config, page_tokens, layer_cache_capacity)
        self.width = layer_cache_capacity // page_tokens
        if pool_pages - RESERVED_PAGES < self.width:
            raise ValueError(f"the page pool ({pool_pages - RESERVED_PAGES} usable pages of "
                             f"{page_tokens} positions) must hold one request of max_context "
                             f"({self.width} pages): raise cache_pool_bytes or lower "
                             f"max_context")
        self._tables = np.full((max_running, self.width), SCRATCH, np.int32)
        self._held = {}  # slot -> the pages its block table names
        self._init_pool = jax.jit(paged_cache.init_pool, static_argnums=(0, 1, 2, 3))
        super().__init__(model, max_context=max_context, slots=max_running,
                         prefill_chunk=prefill_chunk, shadow=shadow)
        self._write = jax.jit(paged_cache.write_pages, static_argnums=(4, 5),
                              donate_argnums=0)
        self._read = jax.jit(paged_cache.read_pages, static_argnums=(2, 3, 4))
        self._put_state = jax.jit(layer_cache.put_state, donate_argnums=0)

    # ------------------------------------------------------------------ admission

    def pages_needed(self, n_tokens, max_tokens):
        return -(-(n_tokens + max_tokens) // self.page_tokens)

    def fits(self, tokens, max_tokens):
        """Whether a request of `tokens` generating up to max_tokens gets its pages now."""
        need = self.pages_needed(len(tokens), max_tokens)
        hits = self._lookup(tokens, hold=False)[0]
        cached_hits = sum(int(self.pages.refs[p] == 0) for p in hits)
        return need - len(hits) <= self.pages.available() - cached_hits

    def _lookup(self, tokens, *, hold):
        if not self.cache_prefixes:
            return [], None
        pages, state = self.pages.lookup(tokens, len(tokens) - 1, needs_state=self.stateful)
        if not hold:
            self.pages.release(pages)
        return pages, state

    def begin_prefill(self, tokens, max_tokens=None):
        """A Prefill holding its pages: the hit prefix's (by reference) and its own. The
        caller checked `fits`; RuntimeError if the pool cannot give them after all."""
        tokens = np.asarray(tokens, np.int32)
        max_tokens = self.max_context - len(tokens) if max_tokens is None else max_tokens
        hits, state = self._lookup(tokens, hold=True)
        own = self.pages.allocate(self.pages_needed(len(tokens), max_tokens) - len(hits))
        if own is None:
            self.pages.release(hits)
            raise RuntimeError("the page pool cannot hold this request now (fits() said "
                               "it could)")
        try:
            prefill = self._workspace(tokens, hits, state)
        except BaseException:
            self.pages.release(hits + own)
            raise
        prefill.pages, prefill.shared_pages = hits + own, len(hits)
        self._prefilling = prefill
        return prefill

    def _workspace(self, tokens, hits, state):
        """The Prefill of `tokens` whose workspace starts with the hit pages' positions."""
        if not hits:
            return Prefill(tokens, self._fresh_cache(), 0, 0)
        hit = len(hits) * self.page_tokens
        ids = np.full(self.width, EMPTY, np.int32)
        ids[:len(hits)] = hits
        cache = self._read(self.pool, jnp.asarray(ids), self.capacity, self.page_tokens,
                           self.config)
        if state is not None:
            cache = self._put_state(cache, self._commit(state))
        return Prefill(tokens, cache, hit, hit)

    def _state_boundary(self, state):
        if not self.stateful or not self.cache_prefixes:
            return None
        end = len(state.tokens) // self.page_tokens * self.page_tokens
        return end if end > state.cache_hit_tokens else None

    def cache_prompt(self, state):
        """Writes the finished prefill's pages past the hit into its own pages and keys its
        full prompt blocks (with a stateful model's state at the last one's end)."""
        if state.pages is None:
            return
        first = state.shared_pages
        n = min(self.width, length_bucket(len(state.pages)))
        ids = np.full(n, SCRATCH, np.int32)
        ids[first:len(state.pages)] = state.pages[first:]
        self.pool = self._write(self.pool, state.cache, jnp.asarray(ids),
                                self.max_running, self.page_tokens, self.config)
        if self.cache_prefixes:
            self.pages.register(state.tokens, state.pages, state=state.snapshot)

    def discard(self, state):
        """Releases a Prefill's pages (the request ended before decode)."""
        if state.pages is not None:
            self.pages.release(state.pages)
            state.pages = None
        self._prefilling = None

    def release(self, slot):
        """Releases the pages of the request decoding in `slot`."""
        pages = self._held.pop(slot, None)
        if pages is not None:
            self.pages.release(pages)
        self._tables[slot] = SCRATCH

    # ------------------------------------------------------------------ decode

    def insert(self, slot, state):
        """Gives decode slot `slot` the finished prefill's block table and its state (the
        pages were written by cache_prompt)."""
        if state.pages is None:  # the warm-up's scratch prefill
            state.cache = None
            return
        if self.stateful:
            self.pool = self._write(self.pool, state.cache, jnp.zeros(0, jnp.int32), slot,
                                    self.page_tokens, self.config)
        self._tables[slot] = EMPTY
        self._tables[slot, :len(state.pages)] = state.pages
        self._held[slot] = state.pages
        state.pages, state.cache, self._prefilling = None, None, None

    def decode(self, batch):
        """One batched step over the running requests: batch {slot: (token, position,
        Sampling, step)} -> {slot: next token}."""
        slots = sorted(batch)
        size = next(b for b in batch_buckets(self.max_running) if b >= len(slots))
        tokens = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int32)
        tables = np.full((size, self.width), SCRATCH, np.int32)
        rows = np.full(size, self.max_running, np.int32)  # the scratch state row
        sampling, steps = [Sampling()] * size, [0] * size
        for i, slot in enumerate(slots):
            token, position, params, step = batch[slot]
            tokens[i], positions[i], tables[i], rows[i] = token, position, self._tables[slot], slot
            sampling[i], steps[i] = params, step
        logits, self.pool = self.runner.decode_paged(tokens, self.pool, tables, positions, rows,
                                                     page_tokens=self.page_tokens)
        out = np.asarray(self._sample(logits, *self._sampling_arrays(sampling, steps)))
        return {slot: int(out[i]) for i, slot in enumerate(slots)}

    def reset_slots(self):
        """An empty pool (at start, and after a failed step consumed it): every decoding
        request's pages and every cached prefix are gone; the prefilling request's pages
        are held again."""
        self.pool = self._init_pool(self.config, self.pages.n_pages, self.page_tokens,
                                    self.max_running)
        self.pool = self._commit(self.pool)
        self._tables[:] = SCRATCH
        self._held.clear()
        self.pages.reset()
        prefill = getattr(self, "_prefilling", None)
        if prefill is not None and prefill.pages is not None:
            # its workspace holds every row, the hit's included: all its pages are its own
            prefill.pages, prefill.shared_pages = self.pages.allocate(len(prefill.pages)), 0

    def page_counts(self):
        return self.pages.counts()

    # ------------------------------------------------------------------ warm-up

    def warmup(self, max_len, room=None):
        """The Engine's warm-up (every batch size's decode step per key-length bucket:
        _warm_decode), then the page copies of every length it warmed."""
        buckets = super().warmup(max_len, room)
        max_len = min(max_len, self.capacity)
        if max_len < 1:
            return buckets
        scratch = self._fresh_cache()
        for n in sorted({min(self.width, length_bucket(-(-k // self.page_tokens)))
                         for k in range(1, max_len + 1)}):
            self.pool = self._write(self.pool, scratch, jnp.full(n, SCRATCH, jnp.int32),
                                    self.max_running, self.page_tokens, self.config)
        if self.cache_prefixes:
            ids = jnp.full(self.width, EMPTY, jnp.int32)
            self._read(self.pool, ids, self.capacity, self.page_tokens, self.config)
        return buckets

    def _warm_decode(self, kv_len):
        for size in batch_buckets(self.max_running):
            self.decode({slot: (0, kv_len - 1, Sampling(), 0) for slot in range(size)})
