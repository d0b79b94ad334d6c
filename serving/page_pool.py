"""The page pool's bookkeeping (host side; the pages themselves are model.paged_cache's
arrays): which pages are free, which a request holds, which hold a cached prompt block.

A page is in one of three states: held (refs > 0: by every running request whose block
table names it), cached (refs == 0 but keyed by a prompt block's hash chain,
serving.prefix_cache.block_keys: a later prompt that starts with that block takes it by
reference, without a copy) or free. `allocate` takes free pages first, then evicts cached
ones least recently used first; held pages are never evicted. Only full prompt blocks are
keyed, so a cached page is never written again: a request writes its own pages only.

Evicted pages are dropped (their rows are overwritten by the next holder): the host
prefix cache of the contiguous-slot layout is not a second tier here.
"""

import collections

import numpy as np

from model.paged_cache import RESERVED_PAGES
from serving.prefix_cache import block_keys


class PagePool:
    def __init__(self, n_pages, page_tokens):
        if n_pages <= RESERVED_PAGES:
            raise ValueError(f"the page pool needs more than {RESERVED_PAGES} pages, got "
                             f"{n_pages}")
        self.n_pages, self.page_tokens = n_pages, page_tokens
        self.refs = np.zeros(n_pages, np.int32)
        self._free = collections.deque(range(RESERVED_PAGES, n_pages))
        self._cached = collections.OrderedDict()  # key -> page, least recently used first
        self._key_of = {}  # page -> key (cached or held pages that hold a keyed block)
        self._page_by_key = {}
        self._state = {}  # key -> a stateful model's state at the block's end (host)
        self.hit_tokens = 0

    @property
    def usable(self):
        return self.n_pages - RESERVED_PAGES

    def counts(self):
        """{"in_use", "shared", "cached", "free"}: held pages, held by more than one
        request, kept only as cached prompt blocks, and empty."""
        held = self.refs > 0
        return {"in_use": int(held.sum()), "shared": int((self.refs > 1).sum()),
                "cached": len(self._cached), "free": len(self._free)}

    def available(self):
        """Pages an allocation can take now (free, then cached ones evicted)."""
        return len(self._free) + len(self._cached)

    # ------------------------------------------------------------------ prefixes

    def lookup(self, tokens, max_tokens, *, needs_state=False):
        """The pages of the longest cached chain of `tokens`' full blocks covering at most
        max_tokens positions, now held once more by the caller -> (pages, state of the last
        block or None). needs_state: the chain ends at the deepest block with a saved state
        (a stateful model resumes only there)."""
        keys = block_keys(tokens, self.page_tokens, max(0, max_tokens) // self.page_tokens)
        pages = []
        for key in keys:
            page = self._page_of(key)
            if page is None:
                break
            pages.append(page)
        if needs_state:
            while pages and keys[len(pages) - 1] not in self._state:
                pages.pop()
        state = self._state.get(keys[len(pages) - 1]) if pages and needs_state else None
        self.hold(pages)
        return pages, state

    def _page_of(self, key):
        return self._page_by_key.get(key)

    def register(self, tokens, pages, *, state=None):
        """Keys the full blocks of `tokens` held in `pages` (page j holds block j) that no
        page holds yet; state: a stateful model's state at the end of the last full block."""
        keys = block_keys(tokens, self.page_tokens)
        for key, page in zip(keys, pages):
            if page in self._key_of or self._page_of(key) is not None:
                continue
            self._key_of[page] = key
            self._page_by_key[key] = page
        if state is not None and keys:
            self._state[keys[-1]] = state

    # ------------------------------------------------------------------ holding

    def allocate(self, n):
        """n pages for one request's own positions, held once -> list, or None when the
        pool cannot give them (nothing is taken then)."""
        if n > self.available():
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                key, page = self._cached.popitem(last=False)
                del self._key_of[page], self._page_by_key[key]
                self._state.pop(key, None)
            pages.append(page)
        self.hold(pages)
        return pages

    def hold(self, pages):
        for page in pages:
            if self.refs[page] == 0 and page in self._key_of:
                self._cached.pop(self._key_of[page], None)
            self.refs[page] += 1

    def release(self, pages):
        """Drops one hold of each page: a page nobody holds is cached if it holds a keyed
        block (most recent last), else free."""
        for page in reversed(pages):  # a chain's root stays more recent than its tail
            self.refs[page] -= 1
            if self.refs[page] < 0:
                raise RuntimeError(f"page {page} released more often than held")
            if self.refs[page] == 0:
                if page in self._key_of:
                    self._cached[self._key_of[page]] = page
                    self._cached.move_to_end(self._key_of[page])
                else:
                    self._free.append(page)

    def reset(self):
        """Every page free and nothing cached (the pool's arrays were lost)."""
        self.__init__(self.n_pages, self.page_tokens)
