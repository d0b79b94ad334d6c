"""DeepSeek-V4's attention of one layer over its own window and its compressed entries.

Queries: q-LoRA (q_a, an RMSNorm, q_b), then an unweighted RMSNorm per head, then the
interleaved RoPE on each head's trailing rope dims. One shared head K = V: kv(x) RMS-normed,
rotated the same way. Each query attends, in one softmax with a learned per-head sink in its
denominator, to the keys of its last `window` positions and to the compressed entries the
layer allows it (HCA: every entry whose window is whole; CSA: the indexer's choice). V
carries the rope, so the output's rope dims are rotated back at the query's position; the
heads then go through the grouped low-rank output projection (o_groups groups of heads each
projected to o_lora_rank, then one map to d_model). Softmax scale head_dim^-0.5.
"""

import jax
import jax.numpy as jnp

from model.deepseek_v4.compressor import interleaved_rope
from model.layers import rms_norm


def project(x, wq_a, q_norm, wq_b, wkv, kv_norm, cos, sin, *, n_heads, eps):
    """x [T, d_model] -> (q [T, H, head_dim], kv [T, head_dim], the q-LoRA residual
    [T, q_lora_rank]: the CSA indexer's query input). Weights as stored, [out, in]."""
    T = x.shape[0]
    q_residual = rms_norm(x @ wq_a.T, q_norm, eps)
    q = rms_norm((q_residual @ wq_b.T).reshape(T, n_heads, -1), None, eps)
    q = interleaved_rope(q, cos, sin)
    kv = interleaved_rope(rms_norm(x @ wkv.T, kv_norm, eps), cos, sin)
    return q, kv, q_residual


def attend(q, keys, visible, sinks, own_keys=None, own_visible=None):
    """Softmax attention with sinks: q [T, H, D], keys = values [L, D] shared by the queries,
    visible bool[T, L], sinks [H]; own_keys [T, k, D] with own_visible bool[T, k]: each
    query's own further keys (a CSA layer's chosen entries), in the same softmax -> [T, H, D]
    (float32 softmax; a row with nothing visible gives 0)."""
    D = q.shape[-1]
    logits = jnp.einsum("thd,ld->thl", q, keys, preferred_element_type=jnp.float32) * D ** -0.5
    parts = [jnp.where(visible[:, None, :], logits, -jnp.inf)]
    if own_keys is not None:
        own = jnp.einsum("thd,tkd->thk", q, own_keys,
                         preferred_element_type=jnp.float32) * D ** -0.5
        parts.append(jnp.where(own_visible[:, None, :], own, -jnp.inf))
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (*logits.shape[:2], 1))
    probs = jax.nn.softmax(jnp.concatenate([*parts, sink], axis=-1), axis=-1)
    L = keys.shape[0]
    out = jnp.einsum("thl,ld->thd", probs[..., :L].astype(keys.dtype), keys)
    if own_keys is not None:
        out = out + jnp.einsum("thk,tkd->thd", probs[..., L:-1].astype(own_keys.dtype),
                               own_keys)
    return out


def window_visible(positions, key_positions, window):
    """bool[T, L]: key position s is in the window of query position t: t - window < s <= t."""
    t, s = positions[:, None], key_positions[None, :]
    return (s <= t) & (s > t - window)


def output(attn, cos, sin, wo_a, wo_b, *, groups):
    """attn [T, H, D] -> [T, d_model]: the rope dims rotated back (-angle), then the grouped
    low-rank projection: wo_a [groups o_lora_rank, H D / groups], wo_b [d_model, groups
    o_lora_rank]."""
    T = attn.shape[0]
    attn = interleaved_rope(attn, cos, -sin).reshape(T, groups, -1)
    per_group = wo_a.reshape(groups, -1, attn.shape[-1])  # [G, o_lora_rank, H D / G]
    low = jnp.einsum("tgi,goi->tgo", attn, per_group).reshape(T, -1)
    return low @ wo_b.T
