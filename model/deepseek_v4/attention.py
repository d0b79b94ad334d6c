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


def window_blocks(keys, start, window):
    """The sliding window in query blocks: keys [window + T, D] at positions start - window ..
    start + T - 1 -> (block keys [nb, window + B, D], visible bool[T, window + B], B) for
    blocks of B = min(T, window) queries: block b reads positions start - window + b B .. (its
    queries' windows), so the work is T (window + B), not T (window + T)."""
    T = keys.shape[0] - window
    B = min(T, window)
    nb = -(-T // B)
    rows = jnp.arange(nb)[:, None] * B + jnp.arange(window + B)[None, :]
    blocked = jnp.pad(keys, ((0, nb * B - T), (0, 0)))[rows]
    key_pos = start - window + rows  # [nb, window + B]
    t = start + jnp.arange(T)
    kp = key_pos[jnp.arange(T) // B]  # each query's block
    visible = (kp <= t[:, None]) & (kp > t[:, None] - window) & (kp >= 0)
    return blocked, visible, B


def attend(q, sinks, window, shared=None, own=None):
    """Softmax attention with sinks, one softmax over three kinds of keys (keys = values):
    window: (block keys [nb, L, D], visible bool[T, L], block size B) from window_blocks;
    shared: (keys [S, D] every query may read, visible bool[T, S]) or None (an HCA layer's
    entries); own: (keys [T, k, D] of each query, visible bool[T, k]) or None (a CSA
    layer's chosen entries). q [T, H, D], sinks [H] -> [T, H, D] (float32 softmax; a row
    with nothing visible gives 0)."""
    T, H, D = q.shape
    scale = D ** -0.5
    wkeys, wvisible, B = window
    nb, L = wkeys.shape[:2]
    blocked_q = jnp.pad(q, ((0, nb * B - T), (0, 0), (0, 0))).reshape(nb, B, H, D)
    logits = jnp.einsum("bqhd,bld->bqhl", blocked_q, wkeys,
                        preferred_element_type=jnp.float32).reshape(nb * B, H, L)[:T]
    parts = [jnp.where(wvisible[:, None, :], logits * scale, -jnp.inf)]
    for keys, visible, form in ((*(shared or (None, None)), "thd,sd->ths"),
                                (*(own or (None, None)), "thd,tkd->thk")):
        if keys is not None:
            part = jnp.einsum(form, q, keys, preferred_element_type=jnp.float32) * scale
            parts.append(jnp.where(visible[:, None, :], part, -jnp.inf))
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (T, H, 1))
    probs = jax.nn.softmax(jnp.concatenate([*parts, sink], axis=-1), axis=-1)
    probs = probs.astype(wkeys.dtype)
    pw = jnp.pad(probs[..., :L], ((0, nb * B - T), (0, 0), (0, 0))).reshape(nb, B, H, L)
    out = jnp.einsum("bqhl,bld->bqhd", pw, wkeys).reshape(nb * B, H, D)[:T]
    used = L
    if shared is not None:
        S = shared[0].shape[0]
        out = out + jnp.einsum("ths,sd->thd", probs[..., used:used + S], shared[0])
        used += S
    if own is not None:
        out = out + jnp.einsum("thk,tkd->thd", probs[..., used:-1], own[0])
    return out


def output(attn, cos, sin, wo_a, wo_b, *, groups):
    """attn [T, H, D] -> [T, d_model]: the rope dims rotated back (-angle), then the grouped
    low-rank projection: wo_a [groups o_lora_rank, H D / groups], wo_b [d_model, groups
    o_lora_rank]."""
    T = attn.shape[0]
    attn = interleaved_rope(attn, cos, -sin).reshape(T, groups, -1)
    per_group = wo_a.reshape(groups, -1, attn.shape[-1])  # [G, o_lora_rank, H D / G]
    low = jnp.einsum("tgi,goi->tgo", attn, per_group).reshape(T, -1)
    return low @ wo_b.T
