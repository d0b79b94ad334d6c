"""The DeepSeekMoE feed-forward (DeepSeek-V3.2, GLM-5): shared experts on every token plus
num_experts_per_tok routed experts chosen by a group-limited sigmoid router.

Only the chosen experts are computed: the T x k (token, expert) assignments are sorted by
expert and run through the grouped-matmul op (pallas_kernels.grouped_matmul: one grouped
matmul per projection over contiguous per-expert row groups; `jax.lax.ragged_dot` on CPU,
a kernel that never densifies on GPU, where XLA's ragged_dot would), then scattered back
with their weights. An all-experts dense path would hold [T, E, F] (~137 GB at 128K tokens
for V3.2); this holds [T k, F]. When T x k <= E (decode: one token per sequence, vmapped
over serving's slots, where ragged_dot has no batching rule) the chosen experts' weights
are gathered instead: the same weights a decode step must read anyway.

Expert parallelism (a mesh whose expert x tensor group has more than one device, inside
model.runner's steps): the routed experts split whole over that group
(model.sharding: "experts" -> ("expert", "tensor")). Every device of the group already
holds the tokens of its sequence shard (attention's output is whole on each), so routing
sends nothing: each device runs the assignments that chose its own experts, and one psum
over the group adds the shares up, the combine an all-to-all would do with the tokens'
return trip (2 (n - 1) / n x d_model values per token and MoE layer through the
all-reduce, for a group of n; experiments.costmodel counts it).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from model import sharding
from model.layers import SwiGLU, swiglu

EXPERT_GROUP = ("expert", "tensor")  # the mesh axes the routed experts split over


def router_scores(x, weight, moe):
    """f32[T, E]: moe.scoring_func of x W^T, in float32."""
    logits = jnp.dot(x.astype(jnp.float32), weight.astype(jnp.float32).T)
    if moe.scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    return jax.nn.sigmoid(logits)


def route(x, weight, bias, moe, *, token_experts=None):
    """The router (MoEConfig's rule) -> (weights f32[T, k], experts i32[T, k]).

    Scores router_scores (sigmoid, or DeepSeek-V4's sqrt(softplus)); the choice ranks scores
    + bias, first over groups (a group's score: the sum of its 2 best choice scores; the
    topk_group best groups stay), then the top num_experts_per_tok experts of the kept
    groups; token_experts i32[T, k] (DeepSeek-V4's hash layers: its frozen token-id table
    read at the tokens) is the choice instead. The weights are the chosen experts' scores
    without the bias, normalised (norm_topk_prob), times routed_scaling_factor."""
    E, G = moe.n_routed_experts, moe.n_group
    scores = router_scores(x, weight, moe)
    if token_experts is not None:
        return _weights(scores, token_experts.astype(jnp.int32), moe)
    choice = scores + bias.astype(jnp.float32)
    if G > 1:
        grouped = choice.reshape(-1, G, E // G)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, kept = jax.lax.top_k(group_scores, moe.topk_group)
        keep = jnp.zeros(group_scores.shape, bool).at[
            jnp.arange(kept.shape[0])[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, moe.num_experts_per_tok)
    return _weights(scores, experts.astype(jnp.int32), moe)


def _weights(scores, experts, moe):
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if moe.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts


def expert_mix(x, weights, experts, stored, scale_block=None, *, implementation=None,
               limit=None, layer=None):
    """sum_j weights[t, j] SwiGLU_{experts[t, j]}(x[t]) -> [T, D], computing only the chosen
    experts. stored: gate, up [E, D, F] and down [E, F, D] in the compute dtype, or those
    in FP8 e4m3 followed by their block scales (gate_scale, up_scale, down_scale) with
    scale_block (the block along each matrix's input axis, along its output axis). Prefill
    runs the grouped-matmul op (pallas_kernels.grouped_matmul: on GPU a kernel that reads
    FP8 tiles as stored; `implementation` picks one); decode (T x k <= E) gathers the
    chosen experts, and dequantizes only those. An expert id >= E (an expert another
    device holds) is skipped: its weight must be 0. limit: swiglu's clamp (None: none).
    layer: None, or the index (traced is fine) of the layer whose experts these are when
    `stored` is a stack of layers' experts ([S, E, ...]: model.layer_stack), read in
    place: decode gathers from the stack, prefill's op reads the layer's groups of it."""
    T, k = experts.shape
    E = stored[0].shape[0 if layer is None else 1]
    mats, scales = stored[:3], (stored[3:] if scale_block else (None,) * 3)
    if T * k <= E:
        ids = jnp.minimum(experts, E - 1).reshape(-1)
        take = (lambda a: a[ids]) if layer is None else (lambda a: a[layer, ids])  # noqa: E731
        picked = [take(m) if s is None else
                  pallas_kernels.dequantize_blocks(take(m), take(s), scale_block, x.dtype)
                  for m, s in zip(mats, scales)]
        g, u, d = (w.reshape(T, k, *w.shape[1:]) for w in picked)
        h = swiglu(jnp.einsum("td,tkdf->tkf", x, g), jnp.einsum("td,tkdf->tkf", x, u), limit)
        y = jnp.einsum("tkf,tkfd->tkd", h, d)
        return jnp.einsum("tk,tkd->td", weights.astype(y.dtype), y).astype(x.dtype)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    # ids >= E sort last and fall outside every group: the op leaves their rows zero
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)

    def grouped(lhs, i):
        return pallas_kernels.grouped_matmul(lhs, mats[i], sizes, rhs_scale=scales[i],
                                             scale_block=scale_block, stack_index=layer,
                                             implementation=implementation)

    rows = x[token]
    h = swiglu(grouped(rows, 0), grouped(rows, 1), limit)
    y = grouped(h, 2)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y.astype(x.dtype))


E4M3 = jnp.float8_e4m3fn


def fp8_scale_block(block):
    """The checkpoint's (rows, cols) block of an [out, in] matrix, as the block along dosa's
    stored [in, out] axes (pallas_kernels.grouped_matmul's scale_block)."""
    return (block[1], block[0])


def scale_shape(shape, block):
    """The transposed block-scale grid of stacked experts of `shape` [E, A, B]."""
    E, A, B = shape
    return (E, -(-A // block[1]), -(-B // block[0]))


class MoE(nnx.Module):
    """Router (`router` [E, D], `bias` [E]: e_score_correction_bias), routed experts
    (`gate`, `up` [E, D, F], `down` [E, F, D]) and the shared experts' SwiGLU. With
    moe.fp8_block the routed experts are e4m3 beside f32 `gate_scale`, `up_scale`,
    `down_scale` (fp8_scale_block), read as stored by the grouped-matmul op. hash_vocab:
    a hash layer (DeepSeek-V4's first layers): `tid2eid` i32[hash_vocab, k] names each
    token id's experts, and the call takes the token ids.

    A call with `layer` runs a block whose routed experts (ROUTED_EXPERTS) were left as
    the whole stack of its layers (model.layer_scan), read in place at that index: a
    layer's experts sliced out of the stack would be copied (11.3 GB per DeepSeek-V3.2
    layer in FP8 on one device)."""

    ROUTED_EXPERTS = ("gate", "up", "down", "gate_scale", "up_scale", "down_scale")

    def __init__(self, d_model, moe, *, rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 hash_vocab=None):
        E, F = moe.n_routed_experts, moe.moe_intermediate_size
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.moe, self.dtype = moe, dtype
        self.router = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (E, d_model),
                                                                 jnp.float32))
        # A hash layer chooses by token id: no choice bias
        self.bias = None if hash_vocab is not None else nnx.Param(jnp.zeros((E,), jnp.float32))
        shapes = {"gate": (E, d_model, F), "up": (E, d_model, F), "down": (E, F, d_model)}
        for name, shape in shapes.items():
            w = init(rngs.params(), shape, jnp.float32 if moe.fp8_block else param_dtype)
            if moe.fp8_block:  # random weights in the released layout: 1 per block
                setattr(self, name, nnx.Param(w.astype(E4M3)))
                setattr(self, f"{name}_scale",
                        nnx.Param(jnp.ones(scale_shape(shape, moe.fp8_block), jnp.float32)))
            else:
                setattr(self, name, nnx.Param(w))
        self.shared = (SwiGLU(d_model, F * moe.n_shared_experts, rngs=rngs, dtype=dtype,
                              param_dtype=param_dtype, limit=moe.swiglu_limit)
                       if moe.n_shared_experts else None)
        if hash_vocab is not None:  # random distinct experts per token id
            draw = jax.random.uniform(rngs.params(), (hash_vocab, E))
            self.tid2eid = nnx.Param(jnp.argsort(draw, axis=1)[:, :moe.num_experts_per_tok]
                                     .astype(jnp.int32))
        else:
            self.tid2eid = None

    def expert_weights(self):
        """(the routed experts' arrays as stored, their scale block or None), for
        model.moe.expert_mix: gate, up, down, and with FP8 their scales after them."""
        names = ("gate", "up", "down")
        stored = tuple(getattr(self, n)[...] for n in names)
        if not self.moe.fp8_block:
            return stored, None
        return (stored + tuple(getattr(self, f"{n}_scale")[...] for n in names),
                fp8_scale_block(self.moe.fp8_block))

    def __call__(self, x, tokens=None, *, layer=None):
        """x [T, D]; tokens i32[T]: the token ids (read by a hash layer only); layer: None,
        or this layer's index in the stack its routed experts hold (class docstring)."""
        mesh = sharding.current_mesh()
        group = 1 if mesh is None else sharding.mesh_axis_sizes(EXPERT_GROUP, mesh.shape)
        stored, scale_block = self.expert_weights()
        token_experts = None
        if self.tid2eid is not None:
            if tokens is None:
                raise ValueError("MoE: a hash layer picks its experts by token id: pass tokens")
            token_experts = self.tid2eid[...][tokens]
        bias = (jnp.zeros((self.moe.n_routed_experts,), jnp.float32) if self.bias is None
                else self.bias[...])
        routed = (expert_parallel_mix if group > 1 else local_mix)(
            x, self.router[...], bias, stored, scale_block, self.moe, mesh, token_experts,
            layer=layer)
        return routed if self.shared is None else routed + self.shared(x)


def local_mix(x, router, bias, stored, scale_block, moe, mesh=None, token_experts=None, *,
              layer=None):
    """The routed experts' output on one device (or under GSPMD): route, then mix.
    stored, scale_block: as MoE.expert_weights gives them; layer: expert_mix's."""
    weights, experts = route(x, router, bias, moe, token_experts=token_experts)
    return expert_mix(x, weights, experts, stored, scale_block, limit=moe.swiglu_limit,
                      layer=layer)


def expert_parallel_mix(x, router, bias, stored, scale_block, moe, mesh, token_experts=None,
                        *, layer=None):
    """local_mix with the experts split over the mesh's EXPERT_GROUP (module docstring):
    each device mixes the assignments of its own experts, a psum over the group adds them.
    Tokens stay split over "sequence" where the chunk divides. layer: expert_mix's (the
    stack's layer axis stays whole on every device)."""
    S = sharding.axis_size(mesh, "sequence")
    rows = P("sequence" if S > 1 and x.shape[0] % S == 0 else None, None)
    stacked = layer is not None
    experts_spec = P(None, EXPERT_GROUP, None, None) if stacked else P(EXPERT_GROUP, None, None)

    def body(x, router, bias, token_experts, layer, *stored):  # stored: this device's experts
        weights, experts = route(x, router, bias, moe, token_experts=token_experts)
        n_local = stored[0].shape[1 if stacked else 0]
        local = experts - jax.lax.axis_index(EXPERT_GROUP) * n_local
        mine = (local >= 0) & (local < n_local)
        out = expert_mix(x, jnp.where(mine, weights, 0.0), jnp.where(mine, local, n_local),
                         stored, scale_block, limit=moe.swiglu_limit,
                         layer=layer if stacked else None)
        return jax.lax.psum(out, EXPERT_GROUP)

    fn = sharding.shard_map(body, mesh=mesh,
                            in_specs=(rows, P(), P(), P() if token_experts is None else rows,
                                      P()) + (experts_spec,) * len(stored),
                            out_specs=rows, check_vma=False)
    return fn(x, router, bias, token_experts, jnp.asarray(layer if stacked else 0, jnp.int32),
              *stored)
