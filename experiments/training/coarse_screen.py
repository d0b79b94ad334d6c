"""Distils the hierarchical indexer's learned coarse screen from the fine indexer, layer by
layer, with the model frozen.

    python -m experiments.training.coarse_screen --out checkpoints/small
    python -m experiments.training.coarse_screen --model smollm2-135m \
        --out checkpoints/smollm2-135m --length 8192

Data: --sequences windows of --length training tokens (experiments.model_source); one
prefill of each (the model's own pass, sparse with flat selection) captures every layer's
indexer inputs for its last --queries positions and its whole key cache. Target of a query:
the share of its flat top-k tokens in each key block (indexer.coarse_screen.
topk_block_shares). Per layer, Adam fits the screen's scales and temperature to the
cross-entropy of softmax(S / tau) over the visible blocks (indexer.coarse_screen.
screen_loss), starting from the mean screen (a = 1, b = c = 0); then the mean screen's own
temperature alone (for the mass budget rule with coarse="mean").

Reports per layer, on a held-out window of the same length: the loss of the mean and the
learned screen, and the recall against flat top-k of the hierarchical indexer at its
configured budget with each. Writes OUT/coarse_screen.safetensors (model.coarse_screen_file:
loaded with the model from then on) and OUT/coarse_screen_log.json.
"""

import argparse
import functools
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import indexer
from experiments.common import (
    ProgressBar,
    display_path,
    enable_compile_cache,
    recorded_command,
    track,
    write_json,
)
from experiments.data import model_indexer_inputs
from experiments.model_source import load_source, training_windows
from indexer.block_summaries import block_summaries
from indexer.coarse_screen import ScreenParams, screen_loss, topk_block_shares
from model.coarse_screen_file import reset_coarse_screens, save_coarse_screen


def layer_examples(model, sequences, n_queries):
    """Per layer, per sequence: (q, w, summaries, target shares, q_offset) as arrays."""
    config = model.config
    B, top_k = config.hierarchical.block_size, config.top_k
    layers = None
    for tokens in sequences:
        L = len(tokens)
        captured = model_indexer_inputs(model, tokens, n_queries)
        if layers is None:
            layers = [[] for _ in captured]
        for i, (q, w, k) in enumerate(captured):
            q, w, k = jnp.asarray(q), jnp.asarray(w), jnp.asarray(k)
            flat = indexer.flat_topk(q, w, k, top_k, q_offset=L - n_queries)
            summaries = block_summaries(k, B)
            target = topk_block_shares(flat, summaries.count.shape[0], B)
            layers[i].append((q, w, summaries, target, L - n_queries, k, flat))
    return layers


def mean_loss(scales, log_t, examples, block_size):
    return sum(screen_loss(scales, log_t, q, w, s, t, block_size=block_size, q_offset=off)
               for q, w, s, t, off in examples) / len(examples)


_ADAM = optax.scale_by_adam()


@functools.partial(jax.jit, static_argnames=("block_size", "train_scales"))
def fit_step(params, opt_state, examples, lr, *, block_size, train_scales):
    """One Adam step on params = (scales, log_temperature) under mean_loss; with
    train_scales=False only the temperature moves. One compilation serves every layer (the
    learning rate is traced, the examples have the same shapes in every layer)."""
    loss, (g_scales, g_log_t) = jax.value_and_grad(
        lambda pt: mean_loss(pt[0], pt[1], examples, block_size))(params)
    if not train_scales:
        g_scales = jnp.zeros_like(g_scales)
    updates, opt_state = _ADAM.update((g_scales, g_log_t), opt_state, params)
    return jax.tree.map(lambda x, u: x - lr * u, params, updates), opt_state, loss


def fit(params, examples, steps, lr, *, block_size, train_scales=True):
    """Adam on params = (scales, log_temperature) -> (params, [loss per step])."""
    opt_state = _ADAM.init(params)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = fit_step(params, opt_state, examples, lr,
                                           block_size=block_size, train_scales=train_scales)
        losses.append(float(loss))
    return params, losses


def heldout_recall(q, w, k, flat, q_offset, config, top_k, screen):
    hier = indexer.hierarchical_topk(q, w, k, top_k, config, q_offset=q_offset, screen=screen)
    return indexer.recall(np.asarray(hier), np.asarray(flat))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="a pretrained model with its warmed indexer (default: the shipped one)")
    p.add_argument("--checkpoint", default=None, help="the shipped model's folder (default: "
                                                      "checkpoints/small)")
    p.add_argument("--out", required=True, help="where coarse_screen.safetensors goes (the "
                                                "model's own folder to ship it with the model)")
    p.add_argument("--length", type=int, default=16384, help="tokens per training window")
    p.add_argument("--serve-length", type=int, default=None,
                   help="the longest context the screens are for (default --length): a "
                        "pretrained model runs with the RoPE scaling of that length "
                        "(length / 8192), as the frontier benchmark and the evaluation do")
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--queries", type=int, default=1024, help="last positions used per window")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("length", "sequences", "queries", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.queries > args.length:
        p.error(f"--queries must be <= --length ({args.length}), got {args.queries}")
    enable_compile_cache()
    t0 = time.monotonic()
    # Captured as deployed: sparse attention over the flat indexer's selection.
    source = load_source(model_name=args.model, checkpoint=args.checkpoint,
                         max_length=max(args.length, args.serve_length or 0),
                         attention="sparse", indexer="flat")
    # From the untrained (mean) screen, whatever screens the folder already holds.
    model, config = reset_coarse_screens(source.model), source.model.config
    B, top_k = config.hierarchical.block_size, config.top_k
    # One more window than trained on: the validation window that decides, per layer,
    # whether the learned screen is kept (it must beat the mean screen there).
    windows = training_windows(source.train_tokens, args.length, args.sequences + 1,
                               seed=args.seed)
    heldout = np.asarray(source.heldout_tokens[:args.length], np.int32)
    if heldout.shape[0] < args.length:
        p.error(f"the held-out text has {heldout.shape[0]} tokens, fewer than --length")
    print(f"{source.name}: capturing indexer inputs of {args.sequences} training windows and "
          f"1 held-out window of {args.length} tokens ({config.n_layers} layers)", flush=True)
    train = layer_examples(model, track(windows[:-1], "capture"), args.queries)
    valid = layer_examples(model, windows[-1:], args.queries)
    test = layer_examples(model, [heldout], args.queries)
    print(f"captured in {time.monotonic() - t0:.0f} s", flush=True)
    hier_mean = config.hierarchical.replace(coarse="mean", coarse_mass=None, exact=False)
    hier_learned = hier_mean.replace(coarse="learned")
    layers_log = []
    with ProgressBar("layers", total=model.config.n_layers) as bar:
        for i in range(model.config.n_layers):
            block = model.layer(i)
            examples = [e[:5] for e in train[i]]
            init = block.coarse_screen.params()
            identity = init.scales  # the untrained screen is the mean screen
            (scales, log_t), losses = fit((init.scales, init.log_temperature), examples,
                                          args.steps, args.lr, block_size=B)
            (_, mean_log_t), mean_losses = fit((identity, init.mean_log_temperature), examples,
                                               args.steps, args.lr, block_size=B,
                                               train_scales=False)
            screen = ScreenParams(scales, log_t, mean_log_t)
            q, w, _, _, off, k, flat = valid[i][0]
            valid_mean = heldout_recall(q, w, k, flat, off, hier_mean, top_k, screen)
            valid_learned = heldout_recall(q, w, k, flat, off, hier_learned, top_k, screen)
            kept = valid_learned > valid_mean
            if not kept:  # the mean screen ranks better here: the layer keeps it (a = 1, b = c = 0)
                scales, log_t = identity, mean_log_t  # and its temperature (the mass rule's)
            screen = ScreenParams(scales, log_t, mean_log_t)
            held = [e[:5] for e in test[i]]

            def test_loss(pt, held=held):
                return mean_loss(pt[0], pt[1], held, B)

            q, w, _, _, off, k, flat = test[i][0]
            entry = dict(
                layer=i, learned_kept=bool(kept), valid_recall_mean=valid_mean,
                valid_recall_learned=valid_learned,
                train_loss_first=losses[0], train_loss_last=losses[-1],
                mean_screen_train_loss=mean_losses[-1],
                heldout_loss_mean=float(test_loss((init.scales, mean_log_t), held)),
                heldout_loss_learned=float(test_loss((scales, log_t), held)),
                temperature=float(jnp.exp(log_t)), mean_temperature=float(jnp.exp(mean_log_t)),
                heldout_recall_mean=heldout_recall(q, w, k, flat, off, hier_mean, top_k, screen),
                heldout_recall_learned=heldout_recall(q, w, k, flat, off, hier_learned, top_k,
                                                      screen),
                heldout_ceiling=indexer.block_recall_ceiling(
                    np.asarray(flat), -(-hier_mean.candidate_tokens // B), B)
                if hier_mean.candidate_tokens else None)
            layers_log.append(entry)
            choice = "learned" if kept else "mean (identity)"
            bar.write(f"layer {i}: validation recall mean {valid_mean:.4f} learned "
                      f"{valid_learned:.4f} -> {choice}; loss {losses[0]:.4f} -> "
                      f"{losses[-1]:.4f} (mean screen, fitted "
                      f"tau: {mean_losses[-1]:.4f}); held-out loss mean "
                      f"{entry['heldout_loss_mean']:.4f} learned "
                      f"{entry['heldout_loss_learned']:.4f}; held-out recall mean "
                      f"{entry['heldout_recall_mean']:.4f} learned "
                      f"{entry['heldout_recall_learned']:.4f} "
                      f"(ceiling {entry['heldout_ceiling']})")
            block.coarse_screen.scales[...] = scales
            block.coarse_screen.log_temperature[...] = log_t
            block.coarse_screen.mean_log_temperature[...] = mean_log_t
            model.set_layer(i, block)  # `block` is layer i's copy: write it back
            bar.advance()
    record = dict(
        command=recorded_command("experiments.training.coarse_screen", argv),
        model=source.name, length=args.length, serve_length=args.serve_length,
        rope_scaling=model.config.rope_scaling, sequences=args.sequences, queries=args.queries,
        steps=args.steps, lr=args.lr, seed=args.seed, top_k=top_k,
        hierarchical=hier_mean.to_dict(), wall_s=round(time.monotonic() - t0, 1),
        machine=f"{platform.machine()} {jax.devices()[0].platform}", layers=layers_log)
    out = pathlib.Path(args.out)
    path = save_coarse_screen(out, model, record=record)
    write_json(out / "coarse_screen_log.json", record)
    mean = {k: float(np.mean([e[k] for e in layers_log])) for k in (
        "heldout_loss_mean", "heldout_loss_learned", "heldout_recall_mean",
        "heldout_recall_learned")}
    print(f"mean over layers: held-out loss {mean['heldout_loss_mean']:.4f} -> "
          f"{mean['heldout_loss_learned']:.4f}, recall at {hier_mean.candidate_tokens} "
          f"candidate tokens {mean['heldout_recall_mean']:.4f} -> "
          f"{mean['heldout_recall_learned']:.4f}; wrote {display_path(path)} "
          f"({record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
