"""The learned coarse screen: block scores from learned per-dimension scales of the
indexer's queries against each block's summary, distilled from the fine indexer (pure
functions; the parameters live in indexer.CoarseScreen, inside every model layer, and are
trained by experiments.training.coarse_screen).

A block's pooled mean hides what the flat top-k looks for: the one or two tokens of the
block that score highest. Its per-dimension max and min keep part of that: for one head,
relu(q) . max - relu(-q) . min bounds q . k over the block's keys (the bound exact mode
uses). The screen scores a block against its features [mean | max | min] (3 d_I, empty
blocks 0) with each indexer head's query rescaled per dimension by learned scales
(a, b, c: f32[H_I, 3, d_I] per layer):

    q'_j = [a_j * q_j | b_j * relu(q_j) | -c_j * relu(-q_j)]
    S[t, b] = sum_j w[t, j] ReLU(q'_j . [mean_b | max_b | min_b])

so each dimension of each head sits anywhere between the pooled mean (a = 1, b = c = 0:
the initialisation, the mean screen exactly) and the bound (a = 0, b = c = 1). Measured on
the shipped model's inputs at 16K this per-dimension form generalised better than a full
per-head projection of [q | relu(q) | relu(-q)] (which fit its training windows better and
held-out text worse; docs/findings.md). The scales act on the query, never on the keys, so
the block summaries stay the incremental cache decode already keeps
(indexer.block_summaries): no per-block state is added; a block costs 3 d_I multiply-adds
per head instead of d_I. The training target of query t is the share of its flat top-k
tokens held by each block; the loss is the cross-entropy of softmax(S / tau) against it
(tau, a learned temperature, is also the temperature of the mass budget rule).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels
from indexer.block_summaries import block_means, visible_blocks

FEATURES = 3  # [mean | max | min]


def screen_features(summaries):
    """f32[n_blocks, 3 d_I]: [mean | max | min] of each block's keys, 0 in empty blocks."""
    nonempty = (summaries.count > 0)[:, None]
    return jnp.concatenate([block_means(summaries), jnp.where(nonempty, summaries.max, 0.0),
                            jnp.where(nonempty, summaries.min, 0.0)], axis=1)


def mean_scales(heads, dim):
    """a = 1, b = c = 0, f32[H_I, 3, d_I]: the learned screen then equals the mean screen."""
    return jnp.zeros((heads, FEATURES, dim), jnp.float32).at[:, 0].set(1.0)


def screen_queries(q, scales):
    """q'_j = [a_j q_j | b_j relu(q_j) | -c_j relu(-q_j)] -> f32[T, H_I, 3 d_I]."""
    q = q.astype(jnp.float32)
    return jnp.concatenate([scales[:, 0] * q, scales[:, 1] * jax.nn.relu(q),
                            -scales[:, 2] * jax.nn.relu(-q)], axis=-1)


def screen_block_scores(q, w, scales, summaries, *, block_size, q_offset=0, q_positions=None,
                        backend=None):
    """Learned block scores f32[T, n_blocks] (-inf where the query does not see the block).

    q [T, H_I, d_I], w [T, H_I], scales f32[H_I, 3, d_I], summaries: BlockSummaryCache.
    Same visibility contract as hierarchical.coarse_block_scores.
    """
    T = q.shape[0]
    q_screen = screen_queries(q, scales).astype(q.dtype)
    features = screen_features(summaries).astype(q.dtype)
    scores = pallas_kernels.index_scores(q_screen, w, features, q_offset=q_offset,
                                         key_block_size=block_size, backend=backend)
    positions = q_offset + jnp.arange(T) if q_positions is None else q_positions
    return jnp.where(visible_blocks(positions, summaries, block_size), scores, -jnp.inf)


def topk_block_shares(selected, n_blocks, block_size):
    """The distillation target f32[T, n_blocks]: the fraction of each query's selected tokens
    (selected i32[T, K], -1 = none, e.g. flat top-k) that falls in each block."""
    T = selected.shape[0]
    blocks = jnp.where(selected >= 0, selected // block_size, n_blocks)
    counts = jnp.zeros((T, n_blocks), jnp.float32).at[jnp.arange(T)[:, None], blocks].add(
        1.0, mode="drop")
    return counts / jnp.maximum(jnp.sum(counts, axis=1, keepdims=True), 1.0)


def screen_loss(scales, log_temperature, q, w, summaries, target, *, block_size, q_offset):
    """Mean over queries of the cross-entropy of softmax(S / tau) (visible blocks) against the
    target shares (topk_block_shares). The xla backend: differentiable."""
    scores = screen_block_scores(q, w, scales, summaries, block_size=block_size,
                                 q_offset=q_offset, backend="xla")
    visible = scores > -jnp.inf
    # Scaled where finite only: -inf * d(1/tau) would turn the gradient into NaN.
    logits = jnp.where(visible, jnp.where(visible, scores, 0.0) * jnp.exp(-log_temperature),
                       -jnp.inf)
    logp = jax.nn.log_softmax(logits, axis=1)
    return -jnp.mean(jnp.sum(jnp.where(target > 0, target * logp, 0.0), axis=1))


def mass_budget(scores, temperature, threshold, forced):
    """Blocks each query keeps under the mass rule -> i32[T]: the fewest of its best blocks
    by `scores` (f32[T, nb], -inf = unseen) whose softmax(scores / temperature) mass reaches
    `threshold`, plus its forced blocks (bool[T, nb]: sink and local, always kept)."""
    free = jnp.where(forced, -jnp.inf, scores)
    p = jax.nn.softmax(free / temperature, axis=1)
    p = jnp.where(jnp.isnan(p), 0.0, p)  # a query seeing forced blocks only
    ranked = -jnp.sort(-p, axis=1)
    before = jnp.cumsum(ranked, axis=1) - ranked  # mass of the better blocks
    needed = jnp.sum((before < threshold) & (ranked > 0), axis=1)
    # Threshold 1 keeps every visible block, including those whose share underflows to 0.
    needed = jnp.where(threshold >= 1.0, jnp.sum(free > -jnp.inf, axis=1), needed)
    return (needed + jnp.sum(forced, axis=1)).astype(jnp.int32)


class ScreenParams(NamedTuple):
    """One layer's trained screen: scales f32[H_I, 3, d_I], log_temperature f32[] (the
    learned screen's), mean_log_temperature f32[] (the mean screen's, fitted alone)."""

    scales: jax.Array
    log_temperature: jax.Array
    mean_log_temperature: jax.Array


def untrained_screen(heads, dim):
    """The initial screen: the mean screen's scores, temperatures 1."""
    return ScreenParams(mean_scales(heads, dim), jnp.zeros((), jnp.float32),
                        jnp.zeros((), jnp.float32))
