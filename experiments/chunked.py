"""Full-sequence passes of a model over its own cache, in chunks (evaluation, indexer studies).

`with_config` gives the same weights under other run-time switches; `ChunkedModel` returns
log-probabilities of a whole sequence read chunk by chunk over the model's KV + indexer-key
cache (chunk c reads keys up to a power-of-two bucket of its end), so no [L, L] matrix is
ever built, and can also collect each layer's flat and another selection on the layer's own
indexer inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.runner import length_bucket
from model.transformer import Transformer, init_cache


def with_config(model, config):
    """The same weights under another run-time config (attention, indexer, rope_scaling...)."""
    other = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(other)
    _, state = nnx.split(model)
    return nnx.merge(graphdef, state)


class ChunkedModel:
    """Full-sequence log-probabilities by chunks over the model's KV + indexer-key cache."""

    def __init__(self, model, *, chunk, recall_config=None):
        self.config = model.config
        self.chunk = chunk
        self.graphdef, self.state = nnx.split(model)
        graphdef = self.graphdef

        def step(state, tokens, cache, start, kv_len):
            m = nnx.merge(graphdef, state)
            logits, cache = m(tokens, cache, start, kv_len)
            return jax.nn.log_softmax(logits, axis=-1), cache

        self._step = jax.jit(step, static_argnames=("kv_len",), donate_argnames=("cache",))
        self._collect = None
        if recall_config is not None:
            from model.attention import select_tokens
            flat_cfg = self.config.replace(indexer="flat")

            def collect(state, tokens, cache, start, kv_len):
                """As step, plus each layer's flat and `recall_config` selections on the
                layer's own indexer inputs: i32[n_layers, T, top_k] each."""
                m = nnx.merge(graphdef, state)
                T = tokens.shape[0]
                positions = start + jnp.arange(T)
                x = m.embed(tokens)
                new_cache, flats, others = [], [], []
                for i, (layer, c) in enumerate(zip(m.layers, cache)):
                    q_i, w_i, _ = layer.indexer(layer.attn_norm(x), positions)
                    x, c = layer(x, c, start, kv_len)
                    keys = c.k_index[:kv_len]
                    flats.append(select_tokens(flat_cfg, q_i, w_i, keys, q_offset=start))
                    others.append(select_tokens(recall_config, q_i, w_i, keys, q_offset=start,
                                                layer=i))
                    new_cache.append(c)
                logits = m.lm_head(m.final_norm(x)).astype(jnp.float32)
                return (jax.nn.log_softmax(logits, axis=-1), new_cache, jnp.stack(flats),
                        jnp.stack(others))

            self._collect = jax.jit(collect, static_argnames=("kv_len",),
                                    donate_argnames=("cache",))

    def new_cache(self, capacity):
        return init_cache(self.config, length_bucket(capacity))

    def _pieces(self, n, start, cap):
        for offset in range(0, n, self.chunk):
            pos = start + offset
            real = min(self.chunk, n - offset)
            size = min(self.chunk, length_bucket(real, minimum=16), cap - pos)
            yield offset, pos, real, size, min(cap, length_bucket(pos + size))

    def logprobs(self, tokens, *, cache=None, start=0, collect_from=None):
        """tokens: int[N] at positions start.. -> (log-probs f32[N, V] numpy, cache,
        selections): selections = (flat, other) i32[n_layers, Q, top_k] for the queries at
        positions >= collect_from (None when not collected)."""
        tokens = np.asarray(tokens, np.int32)
        n = tokens.shape[0]
        if cache is None:
            cache = self.new_cache(start + n)
        cap = cache[0].k.shape[0]
        if start + n > cap:
            raise ValueError(f"cache holds {cap} positions, need {start + n}")
        out = np.zeros((n, self.config.vocab_size), np.float32)
        flats, others = [], []
        for offset, pos, real, size, kv_len in self._pieces(n, start, cap):
            padded = np.zeros(size, np.int32)
            padded[:real] = tokens[offset:offset + real]
            use_collect = (self._collect is not None and collect_from is not None
                           and pos + real > collect_from)
            if use_collect:
                lp, cache, f, o = self._collect(self.state, jnp.asarray(padded), cache, pos,
                                                kv_len)
                first = max(0, collect_from - pos)
                flats.append(np.asarray(f)[:, first:real])
                others.append(np.asarray(o)[:, first:real])
            else:
                lp, cache = self._step(self.state, jnp.asarray(padded), cache, pos, kv_len)
            out[offset:offset + real] = np.asarray(lp)[:real]
        selections = None
        if flats:
            selections = (np.concatenate(flats, axis=1), np.concatenate(others, axis=1))
        return out, cache, selections

    def greedy(self, prompt, cache, start, n_new):
        """Appends prompt at `start` and decodes n_new tokens greedily -> list of ints."""
        lp, cache, _ = self.logprobs(prompt, cache=cache, start=start)
        token = int(np.argmax(lp[-1]))
        out = [token]
        pos = start + len(prompt)
        for _ in range(n_new - 1):
            lp, cache, _ = self.logprobs([token], cache=cache, start=pos)
            token = int(np.argmax(lp[-1]))
            out.append(token)
            pos += 1
        return out
