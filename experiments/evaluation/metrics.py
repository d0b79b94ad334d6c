"""Comparisons of two methods on the same text: next-token agreement and KL of their
distributions, and the overlap of their token selections on identical indexer inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from indexer import iou, recall
from model import length_bucket
from model.attention import select_tokens
from model.cache import cache_capacity, layer_of


def pair_metrics(lp_a, lp_b):
    """Greedy agreement and mean KL(P_a || P_b) over positions."""
    agree = float(np.mean(np.argmax(lp_a, -1) == np.argmax(lp_b, -1)))
    kl = np.sum(np.exp(lp_a) * (lp_a - lp_b), axis=-1, dtype=np.float64)
    return {"agreement": round(agree, 6), "kl_mean": float(np.mean(kl)),
            "kl_max": float(np.max(kl))}


def selection_metrics(flat, other):
    """Per-layer recall and IoU of `other` against `flat` (i32[n_layers, Q, K])."""
    layers = [{"layer": i, "recall": round(recall(other[i], flat[i]), 6),
               "iou": round(iou(other[i], flat[i]), 6)} for i in range(flat.shape[0])]
    return {"layers": layers, "queries": int(flat.shape[1]),
            "recall_mean": round(float(np.mean([x["recall"] for x in layers])), 6),
            "iou_mean": round(float(np.mean([x["iou"] for x in layers])), 6)}


@functools.partial(jax.jit, static_argnames=("config", "layer", "q_offset"))
def _selection(config, layer, q_offset, q, w, k_index, summaries):
    return select_tokens(config, layer, q, w, k_index, q_offset=q_offset, summaries=summaries)


def layer_selection(config, layer, q_offset, q, w, k_index, summaries):
    """Layer `layer`'s selection (model.attention.select_tokens), jitted once per selection
    kind and settings: layers that select alike share one program (30 layers of SmolLM2
    compiled 30 before, 20 s of a cold main job)."""
    key = (config.layer_indexer(layer), config.layer_settings(layer))
    alike = next(i for i in range(config.n_layers)
                 if (config.layer_indexer(i), config.layer_settings(i)) == key)
    return _selection(config, alike, q_offset, q, w, k_index, summaries)


def selections_on_captured(config, captured, cache, q_offset, length):
    """`config`'s selection, layer by layer, on indexer inputs captured from a pass
    (captured["indexer"]: q [n_layers, Q, H_I, d_I], w [n_layers, Q, H_I] for the queries at
    positions q_offset..q_offset+Q-1) over that pass's cache (keys of `length` positions)
    -> i32[n_layers, Q, top_k]. A shared layer (indexer_types) gets its full layer's
    selection, from that layer's inputs and keys: the captures may come from a pass where
    every layer ran its own indexer (the reference a reuse pattern is compared with)."""
    q, w = captured["indexer"].q, captured["indexer"].w
    capacity = cache_capacity(cache)
    kv_len = min(capacity, length_bucket(length))
    # The pass's summaries serve when `config` cuts blocks the same way; else (another
    # block_size, an ablation) the selection builds its own from the keys.
    same_blocks = (layer_of(cache, config, 0).summaries.n_blocks
                   == -(-capacity // config.hierarchical.block_size))
    out = {}
    for i in range(config.n_layers):
        src = config.selection_source(i)
        if src not in out:
            c = layer_of(cache, config, src)
            out[src] = np.asarray(layer_selection(config, src, q_offset, jnp.asarray(q[src]),
                                                  jnp.asarray(w[src]), c.k_index[:kv_len],
                                                  c.summaries if same_blocks else None))
        out[i] = out[src]
    return np.stack([out[i] for i in range(config.n_layers)])
