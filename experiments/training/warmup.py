"""DSA retrofit of a pretrained model: the indexer warm-up of DeepSeek-V3.2 on a frozen base.

    python -m experiments.training.warmup --model smollm2-135m --out checkpoints/smollm2-135m \
        --steps 300 --seq-len 2048

Fresh lightning indexers are put into every layer of the pretrained model (dims:
model.pretrained.llama.RETROFIT_INDEXER); the base stays frozen and only the indexers learn,
by KL(head-summed dense attention || indexer softmax) per layer
(experiments.training.steps.indexer_kl_loss: one forward pass of the model captures both).
Data: experiments.text_corpus (Python sources and English docs; the evaluation text held out).

Writes OUT/indexer.safetensors + OUT/dsa.json (model.pretrained.indexer_weights: the
indexer, the run-time config it is meant for, the base file's sha256, the training record)
and OUT/warmup_log.json + OUT/warmup_curve.png (train KL per step, held-out KL). Resumable:
OUT.work/ (or --work) keeps the weights, optimizer state and record every --save-every steps;
rerunning the same command continues (batches are a pure function of the step).

A second stage on longer windows starts from a finished stage's weights (--init DIR) with
its own work folder; the earlier stages' records travel into the new dsa.json and curve:

    python -m experiments.training.warmup --model smollm2-135m --init checkpoints/smollm2-135m \
        --out checkpoints/smollm2-135m --work checkpoints/smollm2-135m.work-8k \
        --steps 40 --seq-len 8192 --lr 5e-4
"""

import argparse
import json
import math
import pathlib
import platform
import time

import jax
import numpy as np

from experiments.common import (
    ProgressBar,
    enable_compile_cache,
    parse_hierarchical,
    recorded_command,
)
from experiments.data import sample_batch
from experiments.text_corpus import (
    heldout_text_tokens,
    list_documents,
    split_documents,
    token_stream,
)
from experiments.training import steps as ts
from model.pretrained import (
    cache_dir,
    file_sha256,
    load_indexer_weights,
    load_pretrained,
    save_indexer_weights,
)
from model.pretrained.registry import PRETRAINED

TRAIN_STREAM, HELDOUT_OFFSET = 11, 40000  # held-out window: tokens 40000.. of the eval text


def _flat_opt(opt_state):
    return {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(opt_state))}


def _unflat_opt(template, arrays):
    leaves, treedef = jax.tree.flatten(template)
    return jax.tree.unflatten(treedef, [np.asarray(arrays[str(i)]).astype(np.asarray(x).dtype)
                                        for i, x in enumerate(leaves)])


def plot_curve(record, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    offset = 0
    # earlier stages are their warmup_log.json (steps, heldout_kl); this one is the record
    stages = [(st["seq_len"], st["steps"], st["train"], st["heldout_kl"])
              for st in record["previous"]]
    stages.append((record["seq_len"], record["step"], record["train"], record["heldout"]))
    for seq_len, n_steps, train, heldout in stages:
        tag = f"{seq_len} tokens"
        steps, kl = zip(*train) if train else ((), ())
        steps = np.asarray(steps) + offset
        ax.plot(steps, kl, lw=0.8, alpha=0.5, label=f"train KL, {tag} (one sequence)")
        if len(kl) >= 10:
            smooth = np.convolve(kl, np.ones(10) / 10, mode="valid")
            ax.plot(steps[9:], smooth, lw=1.5, label=f"train KL, {tag} (10-step mean)")
        if heldout:
            hs, hk = zip(*heldout)
            ax.plot(np.asarray(hs) + offset, hk, "o-", label=f"held-out KL, {tag} window")
        offset += n_steps
    ax.set_xlabel("step")
    ax.set_ylabel("KL (nats), mean over layers")
    ax.set_yscale("log")
    ax.set_title(record["title"], fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def previous_stages(directory):
    """The warm-up records of the stages that produced `directory`'s indexer, oldest first:
    their warmup_log.json summaries {command, steps, seq_len, tokens, ..., heldout_kl, train}."""
    log = json.loads((pathlib.Path(directory) / "warmup_log.json").read_text())
    return [*log.pop("previous", []), log]


def indexer_optimization(model, stage, work):
    """An indexer stage's optimisation (AdamW without weight decay, clipping 1.0; the base
    frozen) -> (graphdef, trainable, frozen, rest, opt_state, train step, eval loss); the
    optimizer state resumed from WORK/opt.npz when there."""
    tx = ts.make_optimizer(weight_decay=0.0, clip=1.0)
    graphdef, main_p, idx_p, rest = ts.split_model(model)
    trainable, frozen = ts.trainable_of(stage, main_p, idx_p)
    opt_state = tx.init(trainable)
    if (work / "opt.npz").is_file():
        opt_state = _unflat_opt(opt_state, np.load(work / "opt.npz"))
    return (graphdef, trainable, frozen, rest, opt_state, ts.make_train_step(graphdef, stage, tx),
            ts.make_eval_loss(graphdef, stage))


def open_stage(work, weights, model, init, fresh):
    """A stage's record, with `model`'s indexer set to match: resumed from WORK/record.json
    (the indexer from the folder `weights`), else `fresh` starting from the indexer of a
    finished stage `init` (None: fresh indexers) and carrying its stages' records."""
    if (work / "record.json").is_file():
        load_indexer_weights(weights, model)
        record = json.loads((work / "record.json").read_text())
        record.setdefault("previous", [])  # work folders written before stages existed
        print(f"resuming from {work} at step {record['step']}")
        return record
    record = dict(fresh, previous=[])
    if init:
        load_indexer_weights(init, model)
        record["previous"] = previous_stages(init)
        print(f"starting from the indexer of {init} ({len(record['previous'])} earlier "
              "stage(s))")
    return record


def add_runtime_arguments(p):
    """The run-time defaults a stage records in OUT/dsa.json beside its weights."""
    p.add_argument("--top-k", type=int, default=1024,
                   help="top_k recorded as the retrofit's run-time default")
    p.add_argument("--dense-layers", default="",
                   help="layers recorded as kept dense, e.g. 0,1 (run-time default)")
    p.add_argument("--hierarchical", default="", metavar="FIELD=VALUE,...",
                   help="HierarchicalConfig fields recorded as the run-time default, e.g. "
                        "candidate_tokens=4096 (rerunning a finished command with other "
                        "run-time defaults rewrites OUT/dsa.json without training)")


def ship_stage(out, model, args, pre, summary, record):
    """Writes a finished stage: OUT/indexer.safetensors + dsa.json (the run-time config of
    args' --top-k / --dense-layers / --hierarchical, the base file, the stage's summary and
    its earlier stages'), warmup_log.json (the summary with the train curve and the earlier
    stages' logs: what `--init OUT` of a next stage reads) and warmup_curve.png."""
    dense_layers = tuple(int(x) for x in args.dense_layers.split(",") if x.strip())
    hier = parse_hierarchical(args.hierarchical, model.config.hierarchical)
    final = model.config.replace(attention="sparse", top_k=args.top_k, dense_layers=dense_layers,
                                 hierarchical=hier)
    base = dict(name=args.model if args.model in PRETRAINED else None,
                file=pathlib.Path(pre.info["path"]).name, sha256=file_sha256(pre.info["path"]))
    if args.model in PRETRAINED:
        src = PRETRAINED[args.model]
        base.update(package=f"{src.package}=={src.version}", member=src.member)
    stages = [{k: v for k, v in st.items() if k != "train"} for st in record["previous"]]
    save_indexer_weights(out, model, base=base, config=final,
                         metadata=dict(warmup=dict(summary, previous_stages=stages)))
    log = dict(summary, train=record["train"], previous=record["previous"])
    (pathlib.Path(out) / "warmup_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_curve(record, pathlib.Path(out) / "warmup_curve.png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m",
                   help=f"a name ({', '.join(PRETRAINED)}) or a .gguf / HF folder path")
    p.add_argument("--out", required=True, help="directory of the shipped indexer weights")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--heldout-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from the indexer weights of a finished stage (its --out) "
                        "instead of fresh ones")
    p.add_argument("--work", default=None, metavar="DIR",
                   help="resume state folder (default: OUT.work); one per stage")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop (resumably) after this much wall time")
    add_runtime_arguments(p)
    args = p.parse_args(argv)
    enable_compile_cache()
    t0 = time.monotonic()
    out = pathlib.Path(args.out)
    work = pathlib.Path(args.work) if args.work else out.with_name(out.name + ".work")

    pre = load_pretrained(args.model, indexer_dir=None, seed=args.seed, attention="dense")
    model, tok = pre.model, pre.tokenizer
    record = open_stage(work, work, model, args.init,
                        dict(step=0, train=[], heldout=[], wall_s=0.0, tokens=0))
    record["seq_len"] = args.seq_len
    record["title"] = (f"{args.model}: indexer warm-up, {args.seq_len} tokens/step, "
                       f"{platform.machine()} {jax.devices()[0].platform}")

    names = list_documents()
    train_names, _ = split_documents(names)
    tokens = token_stream(tok, train_names, cache=cache_dir() / "corpus")
    heldout = heldout_text_tokens(tok)[HELDOUT_OFFSET:HELDOUT_OFFSET + args.seq_len][None]
    print(f"train tokens {tokens.shape[0]:,} from {len(train_names)} documents; held-out "
          f"window {heldout.shape[1]} tokens of the pydoc text")

    graphdef, trainable, frozen, rest, opt_state, step_fn, eval_fn = indexer_optimization(
        model, "indexer_warmup", work)
    n_params = sum(x.size for x in jax.tree.leaves(trainable))
    print(f"trainable indexer params {n_params:,}; base frozen")

    def save(final=False):
        m = ts.merge_stage(graphdef, "indexer_warmup", trainable, frozen, rest)
        work.mkdir(parents=True, exist_ok=True)
        save_indexer_weights(work, m, base={})
        np.savez(work / "opt.npz", **_flat_opt(opt_state))
        (work / "record.json").write_text(json.dumps(record))
        if final:
            return m

    def heldout_kl():
        return float(eval_fn(trainable, frozen, rest, heldout))

    if not record["heldout"]:
        record["heldout"].append([0, heldout_kl()])
        print(f"held-out KL at step 0: {record['heldout'][-1][1]:.4f}")
    start = time.monotonic()
    stopped = "steps"
    with ProgressBar("indexer warm-up", total=args.steps, completed=record["step"]) as bar:
        for step in range(record["step"], args.steps):
            bar.advance()
            batch = sample_batch(tokens, 1, args.seq_len - 1, seed=args.seed, stream=TRAIN_STREAM,
                                 step=step)
            lr = float(ts.lr_schedule(step, args.steps, peak=args.lr, warmup=args.warmup_steps,
                                      final_frac=0.1))
            trainable, opt_state, metrics = step_fn(trainable, opt_state, frozen, rest, batch, lr)
            kl = float(metrics["loss"])
            if not math.isfinite(kl):
                raise FloatingPointError(f"KL is {kl} at step {step + 1}")
            record["step"] = step + 1
            record["tokens"] += int(batch.size)
            record["train"].append([step + 1, round(kl, 5)])
            bar.status(f"kl={kl:.4f} lr={lr:.1e}")
            if (step + 1) % args.heldout_every == 0 or step + 1 == args.steps:
                record["heldout"].append([step + 1, heldout_kl()])
                bar.write(f"step {step + 1}: held-out KL {record['heldout'][-1][1]:.4f}")
            if (step + 1) % args.save_every == 0:
                record["wall_s"] += time.monotonic() - start
                start = time.monotonic()
                save()
            if args.time_budget_s and time.monotonic() - t0 > args.time_budget_s:
                stopped = "time budget"
                break
    record["wall_s"] += time.monotonic() - start
    model = save(final=True)
    if record["step"] < args.steps:
        print(f"stopped by {stopped} at step {record['step']}/{args.steps}; rerun the same "
              f"command to continue from {work}")
        return
    train_kl = [k for _, k in record["train"]]
    summary = dict(
        command=recorded_command("experiments.training.warmup", argv),
        steps=record["step"], seq_len=args.seq_len, tokens=record["tokens"],
        wall_s=round(record["wall_s"], 1), hardware=f"{platform.machine()}, "
        f"{jax.devices()[0].device_kind}", trainable_params=n_params, lr=args.lr,
        train_kl_first10=round(float(np.mean(train_kl[:10])), 4),
        train_kl_last10=round(float(np.mean(train_kl[-10:])), 4),
        heldout_kl=record["heldout"])
    ship_stage(out, model, args, pre, summary, record)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
