"""Manifold-constrained hyper-connections (mHC): the residual stream as `hc_mult` streams.

Each block reads one input collapsed from the streams and writes its output back:

    pre, post, comb = mix_weights(streams)               # from the streams themselves
    block_input     = sum_n pre[n] * streams[n]
    streams'[k]     = post[k] * block_output + sum_j comb[j, k] * streams[j]

The weights come from one linear map of the unweighted-RMS-normed, flattened streams:
pre = sigmoid(.) + eps, post = 2 sigmoid(.), and comb a softmax made doubly stochastic by
Sinkhorn-Knopp iterations (columns, then rows and columns `sinkhorn_iters - 1` more times),
so mixing streams never grows their norm. A head (`head_collapse`) collapses the streams
once more, with its own pre weights, before the final norm. Everything in float32, as the
reference computes it; the streams keep their dtype.
"""

import jax
import jax.numpy as jnp

from model.layers import rms_norm


def _normed_flat(streams, norm_eps):
    """streams [T, N, D] -> [T, N D] in float32, unweighted-RMS-normed: what every weight of
    the connections is a linear map of."""
    return rms_norm(streams.reshape(streams.shape[0], -1).astype(jnp.float32), None, norm_eps)


def mix_weights(streams, fn, base, scale, *, hc_eps, norm_eps, sinkhorn_iters):
    """streams [T, N, D]; fn [(2 + N) N, N D], base [(2 + N) N], scale [3] (pre, post,
    comb) -> (pre [T, N], post [T, N], comb [T, N, N]), comb[j, k] the share of input
    stream j in output stream k."""
    T, N, _ = streams.shape
    mixed = _normed_flat(streams, norm_eps) @ fn.astype(jnp.float32).T
    base, scale = base.astype(jnp.float32), scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(mixed[:, :N] * scale[0] + base[:N]) + hc_eps
    post = 2 * jax.nn.sigmoid(mixed[:, N:2 * N] * scale[1] + base[N:2 * N])
    logits = mixed[:, 2 * N:].reshape(T, N, N) * scale[2] + base[2 * N:].reshape(N, N)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + hc_eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + hc_eps)
    return pre, post, comb


def collapse(streams, pre):
    """The block's input: streams [T, N, D] weighted by pre [T, N] -> [T, D]."""
    return jnp.einsum("tn,tnd->td", pre, streams.astype(jnp.float32)).astype(streams.dtype)


def expand(block_output, streams, post, comb):
    """The streams after a block: its output [T, D] written into each stream by post, plus
    the input streams mixed by comb -> [T, N, D] in the streams' dtype."""
    dtype = streams.dtype
    return (post.astype(dtype)[:, :, None] * block_output[:, None, :]
            + jnp.einsum("tjk,tjd->tkd", comb.astype(dtype), streams))


def head_collapse(streams, fn, base, scale, *, hc_eps, norm_eps):
    """The final collapse before the model's norm: streams [T, N, D]; fn [N, N D], base [N],
    scale [1] -> [T, D]."""
    pre = jax.nn.sigmoid((_normed_flat(streams, norm_eps) @ fn.astype(jnp.float32).T)
                         * scale.astype(jnp.float32)
                         + base.astype(jnp.float32)) + hc_eps
    return collapse(streams, pre)
