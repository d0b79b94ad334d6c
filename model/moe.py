"""The DeepSeekMoE feed-forward (DeepSeek-V3.2, GLM-5): shared experts on every token plus
num_experts_per_tok routed experts chosen by a group-limited sigmoid router.

Only the chosen experts are computed: the T x k (token, expert) assignments are sorted by
expert and run through `jax.lax.ragged_dot` (one grouped matmul per projection over
contiguous per-expert row groups), then scattered back with their weights. An all-experts
dense path would hold [T, E, F] (~137 GB at 128K tokens for V3.2); this holds [T k, F].
When T x k <= E (decode: one token per sequence, vmapped over serving's slots, where
ragged_dot has no batching rule) the chosen experts' weights are gathered instead: the same
weights a decode step must read anyway.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import SwiGLU


def route(x, weight, bias, moe):
    """The router (MoEConfig's rule) -> (weights f32[T, k], experts i32[T, k]).

    Scores sigmoid(x W^T) in float32; the choice ranks scores + bias, first over groups (a
    group's score: the sum of its 2 best choice scores; the topk_group best groups stay),
    then the top num_experts_per_tok experts of the kept groups; the weights are the chosen
    experts' scores without the bias, normalised (norm_topk_prob), times
    routed_scaling_factor."""
    E, G = moe.n_routed_experts, moe.n_group
    scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), weight.astype(jnp.float32).T))
    choice = scores + bias.astype(jnp.float32)
    if G > 1:
        grouped = choice.reshape(-1, G, E // G)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, kept = jax.lax.top_k(group_scores, moe.topk_group)
        keep = jnp.zeros(group_scores.shape, bool).at[
            jnp.arange(kept.shape[0])[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, moe.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if moe.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts.astype(jnp.int32)


def expert_mix(x, weights, experts, gate, up, down):
    """sum_j weights[t, j] SwiGLU_{experts[t, j]}(x[t]) -> [T, D], computing only the chosen
    experts. gate, up: [E, D, F]; down: [E, F, D]."""
    T, k = experts.shape
    E = gate.shape[0]
    if T * k <= E:
        h = (jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, gate[experts]))
             * jnp.einsum("td,tkdf->tkf", x, up[experts]))
        y = jnp.einsum("tkf,tkfd->tkd", h, down[experts])
        return jnp.einsum("tk,tkd->td", weights.astype(y.dtype), y).astype(x.dtype)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    rows = x[token]
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    y = jax.lax.ragged_dot(h, down, sizes)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y.astype(x.dtype))


class MoE(nnx.Module):
    """Router (`router` [E, D], `bias` [E]: e_score_correction_bias), routed experts
    (`gate`, `up` [E, D, F], `down` [E, F, D]) and the shared experts' SwiGLU."""

    def __init__(self, d_model, moe, *, rngs, dtype=jnp.float32):
        E, F = moe.n_routed_experts, moe.moe_intermediate_size
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.moe = moe
        self.router = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (E, d_model),
                                                                 jnp.float32))
        self.bias = nnx.Param(jnp.zeros((E,), jnp.float32))
        self.gate = nnx.Param(init(rngs.params(), (E, d_model, F), dtype))
        self.up = nnx.Param(init(rngs.params(), (E, d_model, F), dtype))
        self.down = nnx.Param(init(rngs.params(), (E, F, d_model), dtype))
        self.shared = (SwiGLU(d_model, F * moe.n_shared_experts, rngs=rngs, dtype=dtype)
                       if moe.n_shared_experts else None)

    def __call__(self, x):
        weights, experts = route(x, self.router[...], self.bias[...], self.moe)
        out = expert_mix(x, weights, experts, self.gate[...], self.up[...], self.down[...])
        return out if self.shared is None else out + self.shared(x)
