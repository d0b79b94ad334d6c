"""A trained model's own indexer inputs on real text, for indexer benchmarks and studies.

    model_indexer_inputs(model, tokens, n_queries) -> [(q_I, w_I, k_I) per layer]

The model reads `tokens` in chunks over its cache (its configured attention, e.g. sparse
with flat selection, as in deployment); for the last `n_queries` positions each layer's
indexer queries and weights are kept, with the layer's whole indexer-key cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.chunked import ChunkedModel
from model.runner import length_bucket


def model_indexer_inputs(model, tokens, n_queries, *, chunk=None):
    """tokens int[L] -> list over layers of (q f32[Q, H_I, d_I], w f32[Q, H_I], k f32[L, d_I])
    as numpy arrays, for the last Q = n_queries positions (query i at position L - Q + i)."""
    tokens = np.asarray(tokens, np.int32)
    L = int(tokens.shape[0])
    if not 1 <= n_queries <= L:
        raise ValueError(f"n_queries must be in [1, len(tokens) = {L}], got {n_queries}")
    chunk = chunk or model.config.prefill_chunk
    runner = ChunkedModel(model, chunk=chunk)
    cache = runner.new_cache(L)
    start = L - n_queries
    if start:
        _, cache, _ = runner.logprobs(tokens[:start], cache=cache)
    graphdef = runner.graphdef
    kv_len = min(cache[0].k.shape[0], length_bucket(L))

    @jax.jit
    def last_queries(state, toks, cache):
        m = nnx.merge(graphdef, state)
        positions = start + jnp.arange(toks.shape[0])
        x = m.embed(toks)
        out = []
        for layer, c in zip(m.layers, cache):
            q_i, w_i, _ = layer.indexer(layer.attn_norm(x), positions)
            x, c = layer(x, c, start, kv_len)
            out.append((q_i.astype(jnp.float32), w_i.astype(jnp.float32),
                        c.k_index[:L].astype(jnp.float32)))
        return out

    layers = last_queries(runner.state, jnp.asarray(tokens[start:]), cache)
    return [tuple(np.asarray(a) for a in layer) for layer in layers]
