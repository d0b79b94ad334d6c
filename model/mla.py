"""Multi-head latent attention (MLA: DeepSeek-V3.2, GLM-5) over a latent cache.

Per token the cache holds only [c | k_rope] (kv_lora_rank + qk_rope_head_dim values: 576 for
V3.2, against 2 x 128 x 192 for expanded K and V): c = RMSNorm of the kv latent, k_rope its
one rotary key shared by every head. Attention reads it in one of two forms (MLAConfig.absorb):

- absorbed (MQA over the latent, what serving runs): kv_b's key half is folded into each
  head's query, q_lat[h] = q_nope[h] W_uk[h] (kv_lora_rank dims), so a head's score against
  token s is [q_lat[h] | q_rope[h]] . [c_s | k_rope_s], one 576-dim key per token shared by
  all heads; the values are c itself and kv_b's value half W_uv[h] is applied to the
  attention output. Sparse attention is then the GQA kernel with one kv head.
- expanded (the reference form): k[h] = [c W_uk[h] | k_rope], v[h] = c W_uv[h] for every
  read token, standard multi-head attention. The same scores and outputs up to rounding
  (tests/model/test_mla_moe.py).

RoPE as the checkpoints have it: interleaved pairs on the rotary dims of q and k (rotated in
the rotate-half layout after `deinterleave`, which leaves every dot product as it was), with
the model's YaRN frequencies; the softmax scale is qk_head_dim^-0.5 times YaRN's mscale^2.
"""

import jax.numpy as jnp
from flax import nnx

from indexer.rope import apply_rope, deinterleave, rope_angles
from model.layers import RMSNorm


class MLAttention(nnx.Module):
    """MLA projections; the attention itself is the model's (dense or sparse) over the
    (keys, values) this module reads from the cache (the members of model.attention's GQA
    Attention: project, read, output, scale)."""

    def __init__(self, config, *, rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        m = config.mla
        lin = dict(use_bias=False, kernel_init=nnx.initializers.lecun_normal(), dtype=dtype,
                   param_dtype=param_dtype, rngs=rngs)
        self.n_heads, self.mla = config.n_heads, m
        self.rope_theta, self.rope_scaling, self.yarn = (config.rope_theta, config.rope_scaling,
                                                         config.yarn)
        self.q_a = nnx.Linear(config.d_model, m.q_lora_rank, **lin)
        # The latents' norms keep the reference's eps of 1e-6 whatever rms_norm_eps says
        # (transformers' DeepSeek-V3 MLA builds them with the default).
        self.q_a_norm = RMSNorm(m.q_lora_rank, eps=1e-6)
        self.q_b = nnx.Linear(m.q_lora_rank, config.n_heads * m.qk_head_dim, **lin)
        self.kv_a = nnx.Linear(config.d_model, m.kv_lora_rank + m.qk_rope_head_dim, **lin)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, eps=1e-6)
        self.kv_b = nnx.Linear(m.kv_lora_rank,
                               config.n_heads * (m.qk_nope_head_dim + m.v_head_dim), **lin)
        self.wo = nnx.Linear(config.n_heads * m.v_head_dim, config.d_model, **lin)
        factor = 1.0 if config.yarn is None else config.yarn.softmax_scale_factor()
        self.scale = m.qk_head_dim ** -0.5 * factor

    def _kv_b(self):
        """kv_b's kernel [c, H, nope + v] split -> (W_uk [c, H, nope], W_uv [c, H, v])."""
        m = self.mla
        w = self.kv_b.kernel[...].reshape(m.kv_lora_rank, self.n_heads,
                                          m.qk_nope_head_dim + m.v_head_dim)
        return w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:]

    def project(self, x, positions):
        """x: [T, d_model] -> (q [T, H, Dq], cache rows {"kv_latent": [T, latent]}, the
        q-LoRA residual [T, q_lora_rank] (the V3.2 indexer's query input)). Dq is
        kv_lora_rank + qk_rope_head_dim absorbed, qk_head_dim expanded."""
        m, T = self.mla, x.shape[0]
        cos, sin = rope_angles(positions, m.qk_rope_head_dim, theta=self.rope_theta,
                               scaling=self.rope_scaling, yarn=self.yarn)
        q_resid = self.q_a_norm(self.q_a(x))
        q = self.q_b(q_resid).reshape(T, self.n_heads, m.qk_head_dim)
        q_nope = q[..., :m.qk_nope_head_dim]
        q_rope = apply_rope(deinterleave(q[..., m.qk_nope_head_dim:]), cos, sin)
        kv = self.kv_a(x)
        c = self.kv_a_norm(kv[:, :m.kv_lora_rank])
        k_rope = apply_rope(deinterleave(kv[:, m.kv_lora_rank:]), cos, sin)
        if m.absorb:
            w_uk, _ = self._kv_b()
            q_nope = jnp.einsum("thn,chn->thc", q_nope, w_uk.astype(q_nope.dtype))
        rows = {"kv_latent": jnp.concatenate([c, k_rope], axis=-1)}
        return jnp.concatenate([q_nope, q_rope], axis=-1), rows, q_resid

    def read(self, rows):
        """Cache rows {"kv_latent": [L, latent]} -> (keys [L, H_kv, Dq], values [L, H_kv, Dv]):
        one shared head over the latent when absorbed, every head expanded otherwise."""
        m = self.mla
        latent = rows["kv_latent"]
        c, k_rope = latent[:, :m.kv_lora_rank], latent[:, m.kv_lora_rank:]
        if m.absorb:
            return latent[:, None, :], c[:, None, :]
        w_uk, w_uv = self._kv_b()
        L = latent.shape[0]
        k_nope = jnp.einsum("lc,chn->lhn", c, w_uk.astype(c.dtype))
        k_rope = jnp.broadcast_to(k_rope[:, None, :], (L, self.n_heads, m.qk_rope_head_dim))
        return (jnp.concatenate([k_nope, k_rope], axis=-1),
                jnp.einsum("lc,chv->lhv", c, w_uv.astype(c.dtype)))

    def output(self, attn):
        """attn [T, H, Dv] -> [T, d_model] (absorbed: kv_b's value half applied first)."""
        if self.mla.absorb:
            _, w_uv = self._kv_b()
            attn = jnp.einsum("thc,chv->thv", attn, w_uv.astype(attn.dtype))
        return self.wo(attn.reshape(attn.shape[0], -1))
