"""DeepSeek-V4's compressors: windows of `ratio` tokens pooled into one entry.

Per token, a kv and a gate projection; per window, a softmax over the window's slots of the
gate plus a learned bias per slot (`position_bias`, the checkpoints' `ape`) weights the kv;
the pooled entry is RMS-normed and rotated (interleaved RoPE on its trailing `rope_dim`
dims) at its window's first position, i x ratio. Entry i summarises positions
[i ratio, (i + 1) ratio), so a query at position t sees entries i < (t + 1) // ratio.

- HCA (ratio 128 in the releases): non-overlapping windows, projections of head_dim.
- CSA (ratio 4): overlapping windows. The projections are 2 x head_dim wide, two series per
  token: the first half (Ca) joins the *next* window's entry, the second half (Cb) its own.
  Entry i pools 2 x ratio slots: window i-1's Ca slots, then window i's Cb slots (window
  0's Ca slots are empty: zero kv, gate -inf, weight 0). The CSA indexer's keys come from
  a compressor of the same form at index_head_dim.

`compress` runs on whole windows only; a chunked prefill or a decode carries the tokens of
the incomplete window and the last whole window's Ca slots to its next call (`prior`).
"""

import jax
import jax.numpy as jnp

from model.layers import rms_norm


def interleaved_rope(x, cos, sin):
    """RoPE on the trailing 2 x cos.shape[-1] dims of x [T, ..., d], rotating consecutive
    pairs (x[2i], x[2i+1]) by the angle of frequency i; cos, sin: [T, rope_dim // 2]. The
    leading dims pass through. Computed in float32, returned in x's dtype."""
    half = cos.shape[-1]
    lead = x.shape[1:-1]
    cos = cos.reshape(cos.shape[0], *(1,) * len(lead), half)
    sin = sin.reshape(sin.shape[0], *(1,) * len(lead), half)
    rope = x[..., -2 * half:].astype(jnp.float32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    rotated = rotated.reshape(*rope.shape).astype(x.dtype)
    return jnp.concatenate([x[..., :-2 * half], rotated], axis=-1)


def compress(kv, gate, position_bias, norm_weight, rope, *, ratio, overlap, norm_eps,
             first_position=0, prior=None):
    """Entries of the whole windows of kv, gate [T, W] (T a multiple of ratio; W = head_dim,
    or 2 x head_dim with overlap) -> [T // ratio, head_dim].

    position_bias [ratio, W]; norm_weight [head_dim]; rope: positions i32[n] -> (cos, sin),
    the compress RoPE table. first_position: the position of the first window's first token
    (a multiple of ratio). prior (overlap only): (kv, gate) [ratio, head_dim] of the Ca slots
    of the window before the first, or None when there is none."""
    T, W = kv.shape
    if T % ratio:
        raise ValueError(f"compress: {T} tokens are not whole windows of {ratio}")
    n = T // ratio
    kv = kv.reshape(n, ratio, W)
    gate = gate.reshape(n, ratio, W) + position_bias
    if overlap:
        d = W // 2
        if prior is None:
            prior = (jnp.zeros((ratio, d), kv.dtype), jnp.full((ratio, d), -jnp.inf, gate.dtype))
        prev_kv = jnp.concatenate([prior[0][None].astype(kv.dtype), kv[:-1, :, :d]])
        prev_gate = jnp.concatenate([prior[1][None].astype(gate.dtype), gate[:-1, :, :d]])
        kv = jnp.concatenate([prev_kv, kv[:, :, d:]], axis=1)
        gate = jnp.concatenate([prev_gate, gate[:, :, d:]], axis=1)
    weights = jax.nn.softmax(gate.astype(jnp.float32), axis=1).astype(kv.dtype)
    pooled = rms_norm(jnp.sum(kv * weights, axis=1), norm_weight, norm_eps)
    cos, sin = rope(first_position + ratio * jnp.arange(n))
    return interleaved_rope(pooled, cos, sin)


def last_window_prior(kv, gate, position_bias, *, ratio):
    """The Ca slots (kv, gate with its bias) of the last whole window of kv, gate [T, 2 d]:
    what the next call's first CSA entry pools beside its own window."""
    d = kv.shape[-1] // 2
    return kv[-ratio:, :d], gate[-ratio:, :d] + position_bias[:, :d]


def visible_entries(positions, ratio):
    """How many entries a query at each position sees: (t + 1) // ratio."""
    return (positions + 1) // ratio
