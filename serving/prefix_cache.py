"""The index / prefix cache: blocks of prompt tokens keyed by a hash chain, in host memory.

Block i of a prompt (tokens [i P, (i + 1) P), full blocks only) is keyed by
hash(key of block i - 1, its tokens), so a key names the whole prefix up to the block's end
and a hit on block i implies hits on every block before it. Each block holds every layer's
cache rows of its tokens (a model.cache prefix: the keys and values of main attention, the
"kv" part, and the indexer keys with their block summaries, the "index" part; this module
never looks inside): a request whose prefix is cached copies them into its cache and
prefills only the rest.

Eviction is LRU, by entries and by bytes, and never takes a block a request holds. A lookup
touches the matched chain deepest block first, so a chain's root is always more recent than
its descendants and eviction eats prefixes from their ends: what stays is still reachable.
The cache lives in host memory (numpy): the engine thread is its only user.
"""

import collections
import dataclasses
import hashlib

import numpy as np

from model.cache import state_bytes

ROOT = b"dosa-prefix-root"


def block_keys(tokens, block_tokens, n_blocks=None):
    """Hash-chain keys of the first n_blocks full blocks of `tokens` (default: all full)."""
    tokens = np.asarray(tokens, dtype=np.int32)
    full = len(tokens) // block_tokens
    n_blocks = full if n_blocks is None else min(n_blocks, full)
    keys, parent = [], ROOT
    for i in range(n_blocks):
        block = tokens[i * block_tokens:(i + 1) * block_tokens]
        parent = hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclasses.dataclass
class Block:
    """One cached block: its rows of every layer's cache (a host model.cache prefix, opaque
    here) and their bytes by part {"kv", "index"} (model.cache.prefix_bytes); state: for a
    model whose cache keeps state (DeepSeek-V4's rings), that state at the block's end, when
    a prompt ended its full blocks here (model.cache.take_state; None: a prefix may not end
    at this block for such a model)."""

    prefix: list
    part_bytes: dict
    refs: int = 0
    state: list | None = None

    @property
    def kv_bytes(self):
        return self.part_bytes["kv"]

    @property
    def index_bytes(self):
        return self.part_bytes["index"]

    @property
    def state_bytes(self):
        return 0 if self.state is None else state_bytes(self.state)

    @property
    def nbytes(self):
        return self.kv_bytes + self.index_bytes + self.state_bytes


class PrefixCache:
    """LRU map of block key -> Block, bounded by max_blocks entries and max_bytes bytes."""

    def __init__(self, block_tokens, *, max_blocks, max_bytes):
        self.block_tokens = block_tokens
        self.max_blocks, self.max_bytes = max_blocks, max_bytes
        self._blocks = collections.OrderedDict()  # least recently used first
        self.kv_bytes = self.index_bytes = self.state_bytes = 0

    def __len__(self):
        return len(self._blocks)

    @property
    def enabled(self):
        return self.max_blocks > 0 and self.max_bytes > 0

    def lookup(self, tokens, *, max_tokens=None):
        """(keys, blocks) of the longest cached prefix of `tokens`, at most max_tokens tokens
        long; the blocks are held (refs + 1) until `release`."""
        if not self.enabled:
            return [], []
        limit = len(tokens) if max_tokens is None else max_tokens
        keys = block_keys(tokens, self.block_tokens, limit // self.block_tokens)
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        keys = keys[:len(found)]
        for key, block in zip(reversed(keys), reversed(found)):
            block.refs += 1
            self._blocks.move_to_end(key)  # deepest first: the root ends most recent
        return keys, found

    def release(self, blocks):
        for block in blocks:
            block.refs -= 1

    def missing(self, tokens):
        """Indices of the full blocks of `tokens` not cached (those after the cached prefix)."""
        if not self.enabled:
            return []
        keys = block_keys(tokens, self.block_tokens)
        return [i for i, key in enumerate(keys) if key not in self._blocks]

    def insert(self, tokens, blocks):
        """Stores blocks {index: Block} of `tokens`' full blocks, then evicts past the limits.
        Blocks whose parent is not cached are skipped (they would be unreachable)."""
        if not self.enabled:
            return
        keys = block_keys(tokens, self.block_tokens)
        chain = []
        for i, key in enumerate(keys):
            if key not in self._blocks:
                if i not in blocks or blocks[i].nbytes > self.max_bytes:
                    break
                self._blocks[key] = blocks[i]
                self.kv_bytes += blocks[i].kv_bytes
                self.index_bytes += blocks[i].index_bytes
                self.state_bytes += blocks[i].state_bytes
            chain.append(key)
        for key in reversed(chain):
            self._blocks.move_to_end(key)
        self._evict()

    def save_state(self, tokens, index, state):
        """Gives cached block `index` of `tokens` the state at its end (a stateful model's
        prompt ended its full blocks there); nothing when the block is not cached."""
        keys = block_keys(tokens, self.block_tokens, index + 1)
        block = self._blocks.get(keys[-1]) if len(keys) == index + 1 else None
        if block is None or block.state is not None:
            return
        block.state = state
        self.state_bytes += block.state_bytes
        self._evict()

    def _evict(self):
        over = lambda: (len(self._blocks) > self.max_blocks
                        or self.kv_bytes + self.index_bytes + self.state_bytes > self.max_bytes)
        for key in [k for k, b in self._blocks.items() if b.refs == 0]:
            if not over():
                break
            block = self._blocks.pop(key)
            self.kv_bytes -= block.kv_bytes
            self.index_bytes -= block.index_bytes
            self.state_bytes -= block.state_bytes

    def usage(self):
        """Blocks, bytes by part and bytes per cached token by part."""
        tokens = len(self._blocks) * self.block_tokens
        return dict(blocks=len(self._blocks), tokens=tokens, kv_bytes=self.kv_bytes,
                    index_bytes=self.index_bytes, state_bytes=self.state_bytes,
                    kv_bytes_per_token=self.kv_bytes / tokens if tokens else 0.0,
                    index_bytes_per_token=self.index_bytes / tokens if tokens else 0.0)
