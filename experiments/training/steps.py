"""Losses and jitted train steps for the three DSA training stages (pure functions).

Every loss runs the model's own forward pass (model.Transformer.forward); what the indexer
warm-up needs from inside it is captured from that pass, never recomputed by a copy.

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

Stage "indexer_cached": the same loss on a teacher-cache window (experiments.training.teacher:
the frozen model's indexer inputs and attention rows, computed once), at sampled query rows;
a "batch" is one cached window.
"""

import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from model.tokenizer import PAD
from pallas_kernels import index_scores

INDEXER_PARAMS = nnx.All(nnx.Param, nnx.PathContains("indexer"))
MAIN_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))
STAGES = ("dense", "dense_long", "indexer_warmup")  # the stages of experiments.training.train
# every loss a train step can take: the stages, and the retrofit's teacher-cache warm-up
# (experiments.training.retrofit)
LOSS_STAGES = (*STAGES, "indexer_cached")
LM_STAGES = ("dense", "dense_long")
KL_CAPTURE = ("indexer", "attention_target")

LN2 = math.log(2.0)


def _global_norm(tree):
    norm = getattr(getattr(optax, "tree", None), "norm", None)
    return norm(tree) if norm is not None else optax.global_norm(tree)


def split_model(model):
    """-> (graphdef, main params, indexer params, rest); nnx.merge takes them in this order."""
    return nnx.split(model, MAIN_PARAMS, INDEXER_PARAMS, ...)


# ----------------------------------------------------------------------------- losses

def token_nll(logits, targets):
    """Per-position negative log-likelihood in nats: f32[..., T]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def forward_rows(model, inputs, **kwargs):
    """model.forward(row, **kwargs) for each row of inputs int32[B, T], stacked on a leading
    axis. The model goes into the vectorised function as its state and is rebuilt there, so
    the pass's own nnx transforms (remat=True) act on variables of the current trace."""
    graphdef, state = nnx.split(model)

    def row(state, tokens):
        return nnx.merge(graphdef, state).forward(tokens, **kwargs)

    return jax.vmap(row, in_axes=(None, 0))(state, inputs)


def lm_loss(model, batch, *, remat=False):
    """batch: int32[B, T + 1] -> mean next-token NLL (nats) over non-PAD targets.

    remat: rematerialise each block in the backward pass (one block's activations alive at
    a time: long windows in little memory); the same value and gradients."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward_rows(model, inputs, remat=remat)
    nll = token_nll(logits, targets)
    mask = (targets != PAD).astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@jax.checkpoint  # the [T, H_I, T] scores are recomputed in the backward pass, not kept per layer
def indexer_kl(q, w, k, p, q_positions=None):
    """KL(p_t || softmax(I[t, :])) averaged over the T queries t of one layer.

    q: [T, H_I, d_I], w: f32[T, H_I] (the indexer's outputs for the queries), k: [L, d_I]
    (its keys at positions 0..L-1), p: f32[T, L] target rows (distributions over s <= t),
    q_positions: i32[T], the queries' positions (default 0..T-1; a teacher cache's sampled
    rows) -> f32 scalar >= 0. Differentiable w.r.t. q, w, k (the XLA scoring path: a Pallas
    kernel has no VJP)."""
    if q_positions is None:
        q_positions = jnp.arange(q.shape[0])
    scores = index_scores(q, w, k, causal=False, backend="xla")
    visible = jnp.arange(k.shape[0])[None, :] <= q_positions[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    log_q = jnp.where(visible, jax.nn.log_softmax(scores, axis=-1), 0.0)
    log_p = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
    return jnp.mean(jnp.sum(p * (log_p - log_q), axis=-1))


def indexer_kl_loss(model, batch, *, remat=False):
    """batch: int32[B, T] (a trailing target column is just one more query) -> KL averaged
    over queries, layers and sequences.

    One forward pass of `model` (config attention="dense") per sequence captures each
    layer's indexer outputs and head-summed attention (detached); gradients reach only the
    indexer's parameters. ValueError when the model's attention is not dense."""
    if model.config.attention != "dense":
        raise ValueError("the indexer warm-up's KL target is the dense attention: the model "
                         f"needs attention='dense' (got {model.config.attention!r})")

    _, captured = forward_rows(model, batch, capture=KL_CAPTURE, remat=remat)
    one = jax.vmap(indexer_kl)  # over the sequences
    kls = [one(*inputs, p)
           for inputs, p in zip(captured["indexer"], captured["attention_target"])]
    return jnp.mean(jnp.stack(kls))


def cached_indexer_kl_loss(model, window):
    """The warm-up's KL on a teacher-cache window (experiments.training.teacher): the same
    loss at the window's sampled query rows, without running the model.

    window: hidden [n_full, T, d] (each full layer's indexer input, in layer order),
    target f32/bf16[n_layers, R, T] (each layer's head-summed dense attention at the rows),
    rows i32[R], and query_hidden [n_full, T, q_dim] when the indexer reads one -> KL
    averaged over rows and layers. A shared layer's target trains the indexer of the full
    layer whose selection it attends to. Gradients reach only the indexers' parameters."""
    config = model.config
    dtype = jnp.dtype(config.dtype)
    full = [i for i in range(config.n_layers) if not config.layer_is_shared(i)]
    rows = window["rows"]
    positions = jnp.arange(window["hidden"].shape[1])
    query_hidden = window.get("query_hidden")
    outputs = {}
    for slot, layer in enumerate(full):
        outputs[layer] = model.layer(layer).indexer(
            window["hidden"][slot].astype(dtype), positions, query_rows=rows,
            query_hidden=None if query_hidden is None else query_hidden[slot].astype(dtype))
    kls = []
    for layer in range(config.n_layers):
        p = window["target"][layer].astype(jnp.float32)
        p = p / jnp.sum(p, axis=-1, keepdims=True)  # bf16 rows sum to 1 only to 3 digits
        kls.append(indexer_kl(*outputs[config.selection_source(layer)], p, rows))
    return jnp.mean(jnp.stack(kls))


def stage_loss(stage, *, remat=False):
    """The loss(model, batch) of a stage."""
    if stage in LM_STAGES:
        return functools.partial(lm_loss, remat=remat)
    if stage == "indexer_warmup":
        return functools.partial(indexer_kl_loss, remat=remat)
    if stage == "indexer_cached":
        return cached_indexer_kl_loss
    raise ValueError(f"unknown stage {stage!r}; choose one of {LOSS_STAGES}")


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


def trainable_of(stage, main, indexer):
    """-> (trainable, frozen) parameter states of a stage."""
    if stage not in LOSS_STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {LOSS_STAGES}")
    return (main, indexer) if stage in LM_STAGES else (indexer, main)


def merge_stage(graphdef, stage, trainable, frozen, rest):
    main, idx = (trainable, frozen) if stage in LM_STAGES else (frozen, trainable)
    return nnx.merge(graphdef, main, idx, rest)


def make_train_step(graphdef, stage, tx, *, micro_batches=1, remat=False):
    """-> jitted step(trainable, opt_state, frozen, rest, batch, lr)
           -> (trainable, opt_state, metrics); trainable and opt_state are donated.

    micro_batches > 1 splits the batch into that many equal slices and averages their
    gradients (a lax.scan): the same update in less memory (CPU reproductions); remat
    recomputes each block in the backward pass."""
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
