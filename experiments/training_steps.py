"""Losses and jitted train steps for the three DSA training stages (pure functions).

Stage "dense": next-byte cross-entropy with dense attention; every parameter except the
indexers' is trained (the indexer only sees detached inputs, so the LM loss gives it no
gradient; leaving it out also keeps weight decay off it).

Stage "dense_long": the same loss and parameters on longer windows (a short length
curriculum for long-context use).

Stage "indexer_warmup" (DeepSeek-V3.2 dense warm-up): the main model is frozen, the indexer's
inputs are detached and only indexer parameters are trained with, per layer,

    KL(p_t || softmax(I[t, :]))     p_t = main attention probabilities of query t summed over
                                          heads and L1-normalised (causal, s <= t)

averaged over queries and layers.
"""

import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from indexer import index_scores
from model.tokenizer import PAD

INDEXER_PARAMS = nnx.All(nnx.Param, nnx.PathContains("indexer"))
MAIN_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))
STAGES = ("dense", "dense_long", "indexer_warmup")
LM_STAGES = ("dense", "dense_long")

LN2 = math.log(2.0)


def _global_norm(tree):
    norm = getattr(getattr(optax, "tree", None), "norm", None)
    return norm(tree) if norm is not None else optax.global_norm(tree)


def split_model(model):
    """-> (graphdef, main params, indexer params, rest); nnx.merge takes them in this order."""
    return nnx.split(model, MAIN_PARAMS, INDEXER_PARAMS, ...)


# ----------------------------------------------------------------------------- LM loss

def token_nll(logits, targets):
    """Per-position negative log-likelihood in nats: f32[..., T]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def lm_loss(model, batch):
    """batch: int32[B, T + 1] -> mean next-token NLL (nats) over non-PAD targets."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = jax.vmap(model.forward)(inputs)
    nll = token_nll(logits, targets)
    mask = (targets != PAD).astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _dense_layer(layer, x, positions):
    """One decoder block with dense causal attention, from the block's submodules."""
    from model.attention import dense_causal_attention
    h = layer.attn_norm(x)
    q, k, v = layer.attn.project(h, positions)
    x = x + layer.attn.output(dense_causal_attention(q, k, v))
    return x + layer.mlp(layer.mlp_norm(x))


def remat_dense_forward(model, tokens):
    """Dense full-sequence logits with each block rematerialised in the backward pass
    (jax.checkpoint): the same values as model.forward with attention="dense", with one
    block's activations alive at a time (long windows on a CPU)."""
    positions = jnp.arange(tokens.shape[0])
    x = model.embed(tokens)
    for layer in model.layers:
        x = jax.checkpoint(functools.partial(_dense_layer, layer))(x, positions)
    return model.lm_head(model.final_norm(x)).astype(jnp.float32)


def lm_loss_remat(model, batch):
    """lm_loss through remat_dense_forward."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = jax.vmap(lambda t: remat_dense_forward(model, t))(inputs)
    nll = token_nll(logits, targets)
    mask = (targets != PAD).astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


# ------------------------------------------------------ dense forward with attention maps

def _attention_with_head_sum(q, k, v):
    """Dense causal GQA attention (as model.attention.dense_causal_attention) that also
    returns p[t, s] = sum over heads of the attention probabilities, L1-normalised.

    q: [T, H, D], k/v: [T, H_kv, D] -> (out [T, H, D], p f32[T, T])."""
    T, H, D = q.shape
    H_kv = k.shape[1]
    qg = q.reshape(T, H_kv, H // H_kv, D)
    logits = jnp.einsum("tgrd,lgd->tgrl", qg, k, preferred_element_type=jnp.float32) * D**-0.5
    visible = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("tgrl,lgd->tgrd", probs, v.astype(jnp.float32))
    p = jnp.sum(probs, axis=(1, 2))
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    return out.reshape(T, H, v.shape[-1]).astype(q.dtype), p


def dense_forward_with_attention(model, tokens):
    """One sequence through the model with dense attention, built from the layers'
    submodules -> (logits f32[T, V], indexer inputs h [n_layers, T, d_model],
    head-summed attention p f32[n_layers, T, T])."""
    T = tokens.shape[0]
    positions = jnp.arange(T)
    x = model.embed(tokens)
    hs, ps = [], []
    for layer in model.layers:
        h = layer.attn_norm(x)
        q, k, v = layer.attn.project(h, positions)
        out, p = _attention_with_head_sum(q, k, v)
        x = x + layer.attn.output(out)
        x = x + layer.mlp(layer.mlp_norm(x))
        hs.append(h)
        ps.append(p)
    logits = model.lm_head(model.final_norm(x)).astype(jnp.float32)
    return logits, jnp.stack(hs), jnp.stack(ps)


def attention_target(model, tokens):
    """KL targets p [n_layers, T, T] (each row a distribution over s <= t) and the
    indexer inputs h [n_layers, T, d_model], both detached."""
    _, hs, ps = dense_forward_with_attention(model, tokens)
    return jax.lax.stop_gradient(hs), jax.lax.stop_gradient(ps)


def indexer_kl(indexer, h, p):
    """KL(p_t || softmax(I[t, :])) averaged over queries t, for one layer.

    h: [T, d_model] (detached indexer input), p: f32[T, T] target rows."""
    T = h.shape[0]
    positions = jnp.arange(T)
    q, w, k = indexer(jax.lax.stop_gradient(h), positions)
    # Always the differentiable jnp path: a Pallas kernel has no VJP.
    scores = index_scores(q, w, k, backend="xla")
    visible = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
    log_q = jnp.where(visible, jax.nn.log_softmax(scores, axis=-1), 0.0)
    log_p = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
    return jnp.mean(jnp.sum(p * (log_p - log_q), axis=-1))


def indexer_kl_loss(model, batch):
    """batch: int32[B, T (+1)] -> KL averaged over sequences, layers and queries."""
    def one(tokens):
        hs, ps = attention_target(model, tokens)
        kls = [indexer_kl(layer.indexer, hs[i], ps[i]) for i, layer in enumerate(model.layers)]
        return jnp.mean(jnp.stack(kls))

    return jnp.mean(jax.vmap(one)(batch))


# ------------------------------------------------------------------- optimisation

def lr_schedule(step, total, *, peak, warmup, final_frac):
    """Linear warm-up to `peak` over `warmup` steps, then cosine to final_frac * peak at
    `total`. step/total may be traced."""
    step = jnp.asarray(step, jnp.float32)
    total = jnp.asarray(total, jnp.float32)
    warm = peak * jnp.minimum(1.0, (step + 1.0) / max(1, warmup))
    progress = jnp.clip((step - warmup) / jnp.maximum(1.0, total - warmup), 0.0, 1.0)
    final = peak * final_frac
    cosine = final + (peak - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(step < warmup, warm, cosine)


def make_optimizer(*, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0):
    """AdamW direction without the learning rate (the step multiplies by -lr): clipping,
    Adam, decoupled weight decay on matrices only."""
    def decay_mask(params):
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    parts = []
    if clip:
        parts.append(optax.clip_by_global_norm(clip))
    parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
    return optax.chain(*parts)


def stage_loss(stage, *, remat=False):
    if stage in LM_STAGES:
        return lm_loss_remat if remat else lm_loss
    if stage == "indexer_warmup":
        return indexer_kl_loss
    raise ValueError(f"unknown stage {stage!r}; choose one of {STAGES}")


def trainable_of(stage, main, indexer):
    """-> (trainable, frozen) parameter states of a stage."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {STAGES}")
    return (main, indexer) if stage in LM_STAGES else (indexer, main)


def merge_stage(graphdef, stage, trainable, frozen, rest):
    main, idx = (trainable, frozen) if stage in LM_STAGES else (frozen, trainable)
    return nnx.merge(graphdef, main, idx, rest)


def make_train_step(graphdef, stage, tx, *, micro_batches=1, remat=False):
    """-> jitted step(trainable, opt_state, frozen, rest, batch, lr)
           -> (trainable, opt_state, metrics); trainable and opt_state are donated.

    micro_batches > 1 splits the batch into that many equal slices and averages their
    gradients (a lax.scan): the same update in less memory (CPU reproductions); remat
    recomputes each block in the backward pass (LM stages)."""
    loss_fn = stage_loss(stage, remat=remat)

    def objective(trainable, frozen, rest, batch):
        return loss_fn(merge_stage(graphdef, stage, trainable, frozen, rest), batch)

    grad_fn = jax.value_and_grad(objective)

    def loss_and_grads(trainable, frozen, rest, batch):
        if micro_batches == 1:
            return grad_fn(trainable, frozen, rest, batch)
        B = batch.shape[0]
        if B % micro_batches:
            raise ValueError(f"batch size {B} is not a multiple of micro_batches "
                             f"{micro_batches}")
        slices = batch.reshape(micro_batches, B // micro_batches, *batch.shape[1:])

        def body(acc, micro):
            loss, grads = grad_fn(trainable, frozen, rest, micro)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, trainable))
        (loss, grads), _ = jax.lax.scan(body, zero, slices)
        return jax.tree.map(lambda x: x / micro_batches, (loss, grads))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable, opt_state, frozen, rest, batch, lr):
        loss, grads = loss_and_grads(trainable, frozen, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        trainable = optax.apply_updates(trainable, updates)
        return trainable, opt_state, {"loss": loss, "grad_norm": _global_norm(grads)}

    return step


def make_eval_loss(graphdef, stage):
    """-> jitted loss(trainable, frozen, rest, batch) (no update)."""
    loss_fn = stage_loss(stage)

    @jax.jit
    def evaluate(trainable, frozen, rest, batch):
        return loss_fn(merge_stage(graphdef, stage, trainable, frozen, rest), batch)

    return evaluate
