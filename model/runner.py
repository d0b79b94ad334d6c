"""Prefill and decode over a cache: jitted steps, length buckets, chunked prefill."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.sampling import sample_token, validate_sampling
from model.transformer import init_cache

MIN_BUCKET = 256


def length_bucket(n, minimum=MIN_BUCKET):
    """Smallest power of two >= max(n, minimum): compiled shapes stay few (log2 of the
    context) while compute stays within 2x of the real length."""
    return max(minimum, 1 << (int(n) - 1).bit_length())


class ModelRunner:
    """Runs one sequence at a time through a Transformer with a KV + indexer-key cache.

    Prefill is chunked: chunk c of `prefill_chunk` tokens reads keys up to
    length_bucket(end of chunk), so compute grows with the real context, not a padded
    maximum; the last chunk is padded up to a power-of-two bucket, never past one chunk.
    """

    def __init__(self, model):
        self.config = model.config
        self.graphdef, self.state = nnx.split(model)

        def step(state, tokens, cache, start, kv_len, logit_index):
            model = nnx.merge(self.graphdef, state)
            # Rows past logit_index are padding: kept out of the block summaries.
            logits, cache = model(tokens, cache, start, kv_len, n_valid=logit_index + 1)
            return logits[logit_index], cache

        self._step = jax.jit(step, static_argnames=("kv_len",), donate_argnames=("cache",))

    def new_cache(self, capacity):
        if capacity > self.config.max_seq_len:
            raise ValueError(f"context of {capacity} tokens exceeds max_seq_len="
                             f"{self.config.max_seq_len}")
        return init_cache(self.config, length_bucket(capacity))

    def prefill(self, tokens, *, cache=None, capacity=None, chunk=None, start=0):
        """tokens: ints [N] -> (last-position logits f32[V], cache). Positions start..start+N-1.

        capacity: positions the cache must hold (default N + start; serving adds room for
        decoding). A given cache is extended in place (prefix reuse: start > 0).
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        n = int(tokens.shape[0])
        if n < 1:
            raise ValueError("prefill needs at least one token")
        chunk = chunk or self.config.prefill_chunk
        if cache is None:
            cache = self.new_cache(capacity or (start + n))
        cap = cache[0].k.shape[0]
        if start + n > cap:
            raise ValueError(f"cache holds {cap} positions, prefill needs {start + n}")
        logits = None
        for offset in range(0, n, chunk):
            piece = tokens[offset:offset + chunk]
            pos = start + offset
            # Pad to a power-of-two bucket (few compiled shapes) but never past the cache:
            # dynamic_update_slice would clamp the write back over earlier positions.
            size = min(chunk, length_bucket(len(piece), minimum=16), cap - pos)
            padded = np.zeros(size, np.int32)
            padded[:len(piece)] = piece
            kv_len = min(cap, length_bucket(pos + size))
            logits, cache = self._step(self.state, jnp.asarray(padded), cache, pos, kv_len,
                                       len(piece) - 1)
        return logits, cache

    def decode(self, token, cache, position):
        """Appends `token` at `position`; returns (logits f32[V] for the next token, cache)."""
        cap = cache[0].k.shape[0]
        if position >= cap:
            raise ValueError(f"cache holds {cap} positions, decode at position {position}")
        kv_len = min(cap, length_bucket(position + 1))
        return self._step(self.state, jnp.asarray([token], jnp.int32), cache, position, kv_len, 0)

    def generate(self, prompt, max_new_tokens, *, temperature=0.0, top_p=1.0, seed=0,
                 stop_tokens=()):
        """Yields generated token ids one at a time (prefill first, then decode)."""
        validate_sampling(temperature, top_p)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        n = len(prompt)
        logits, cache = self.prefill(prompt, capacity=n + max_new_tokens)
        key = jax.random.key(seed)
        for i in range(max_new_tokens):
            key, sub = jax.random.split(key)
            token = int(sample_token(logits, sub, temperature, top_p))
            yield token
            if token in stop_tokens or i == max_new_tokens - 1:
                return
            logits, cache = self.decode(token, cache, n + i)

