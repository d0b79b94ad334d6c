"""DSA retrofit of a pretrained model, at the cost of its teacher: the indexer warm-up
(V3.2's dense stage: KL to the frozen model's head-summed attention) trained on a teacher
cache, so the frozen model runs once per window, not once per step.

    python -m experiments.training.retrofit --model smollm2-135m --init checkpoints/smollm2-135m \
        --out runs/retrofit/stage1 --seq-len 8192 --windows 24 --rows 256 --epochs 8 \
        --time-budget-s 5400

1. Teacher (experiments.training.teacher): --windows windows of --seq-len tokens of the
   training corpus, a --repeat-share of them with spans repeated at random distances; per
   window one dense forward of the frozen model keeps every full layer's indexer input and
   every layer's attention at --rows stratified query rows (bfloat16, in WORK/teacher; a
   rerun reuses what is there). The held-out window (the pydoc text at the warm-up's
   held-out offset) gets --heldout-rows rows. With --copy-rows a share of each repeat
   window's rows lies inside its copies, and a second held-out window (the same text with
   repeats, rows likewise) joins the criterion.
2. Train: all layers' indexers on the cached windows, one window per step, epochs in a
   seeded order, AdamW (no weight decay) with warm-up and cosine decay over the planned
   steps; after each epoch the held-out KL at the cached rows decides: the best epoch's
   weights are kept, and --patience epochs without improvement stop the stage.
3. Ship: OUT/indexer.safetensors, dsa.json, warmup_log.json, warmup_curve.png in the
   warm-up's formats (experiments.training.warmup.ship_stage), so a next stage takes
   `--init OUT` and the evaluation `--indexer-dir OUT`; the record adds the teacher and
   training wall times, the cache size, the cost per million teacher tokens and the
   warm-up's exact held-out KL (every query) at 2048 and --seq-len tokens.

Reuse across layers (`--indexer-types freq2`, or an F/S string per layer): only the kept
layers have indexers, and each learns its own layer's target and those of the layers that
reuse its selection (steps.cached_indexer_kl_loss); dsa.json serves the pattern. The teacher
cache holds every layer's input whatever the pattern, so `--teacher` can point at another
stage's WORK/teacher (same plan, seed and model) and the stage costs only its training.

Resumable: WORK (default OUT.work) keeps the cache, the last and best weights, the optimizer
state and the record after each epoch; rerunning the same command continues.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import enable_compile_cache, recorded_command, track
from experiments.text_corpus import (
    heldout_text_tokens,
    list_documents,
    split_documents,
    token_stream,
)
from experiments.training import steps as ts
from experiments.training.teacher import (
    TeacherCache,
    WindowPlan,
    fill,
    full_layers,
    make_teacher,
    repeat_spans,
    stratified_rows,
    training_window,
    window_rows,
)
from experiments.training.warmup import (
    HELDOUT_OFFSET,
    _flat_opt,
    add_runtime_arguments,
    indexer_optimization,
    open_stage,
    ship_stage,
)
from model import with_config
from model.config import reuse_types
from model.pretrained import (
    cache_dir,
    file_sha256,
    load_indexer_weights,
    load_pretrained,
    save_indexer_weights,
)
from model.pretrained.registry import PRETRAINED

HELDOUT, HELDOUT_COPY = "heldout", "heldout_copy"


def window_arrays(entry, full=None):
    """A cache entry as the cached loss takes it (jnp arrays; bf16 stays bf16). The cache
    holds the indexer input of every layer the base model runs an indexer in; full: the
    slots of those a reuse pattern keeps, None: all."""
    keys = ("hidden", "target", "rows", "query_hidden")
    out = {k: entry[k] for k in keys if k in entry}
    if full is not None:
        for k in ("hidden", "query_hidden"):
            if k in out:
                out[k] = out[k][np.asarray(full)]
    return {k: jnp.asarray(v) for k, v in out.items()}


def exact_heldout_kl(model, tokenizer, length):
    """The warm-up's own held-out measure: the KL over every query of the pydoc window at
    HELDOUT_OFFSET (one full forward of the dense model)."""
    graphdef, main_p, idx_p, rest = ts.split_model(model)
    trainable, frozen = ts.trainable_of("indexer_warmup", main_p, idx_p)
    window = heldout_text_tokens(tokenizer)[HELDOUT_OFFSET:HELDOUT_OFFSET + length][None]
    kl = float(ts.make_eval_loss(graphdef, "indexer_warmup")(trainable, frozen, rest, window))
    jax.clear_caches()
    return kl


def parse_token_range(text, flag):
    lo, _, hi = text.partition(",")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{flag} takes LO,HI (token counts), got {text!r}") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m",
                   help=f"a name ({', '.join(PRETRAINED)}) or a .gguf / HF folder path")
    p.add_argument("--out", required=True, help="directory of the stage's indexer weights")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from a finished stage's indexer weights (its --out)")
    p.add_argument("--work", default=None, metavar="DIR",
                   help="cache and resume folder (default OUT.work)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--windows", type=int, default=24, help="teacher windows")
    p.add_argument("--rows", type=int, default=256, help="query rows kept per window")
    p.add_argument("--first-row", type=int, default=0,
                   help="rows are drawn from positions >= this")
    p.add_argument("--repeat-share", type=float, default=0.5,
                   help="share of windows with repeated spans")
    p.add_argument("--spans", type=int, default=8, help="repeated spans per such window")
    p.add_argument("--span-tokens", default="16,128", metavar="LO,HI")
    p.add_argument("--copy-distance", default=None, metavar="LO,HI",
                   help="each copy's distance back to its source, uniform in [LO, HI] "
                        "tokens (default: source and destination uniform in the window)")
    p.add_argument("--copy-rows", type=float, default=0.0,
                   help="share of a repeat window's rows drawn inside its copies; > 0 adds "
                        "a held-out window with repeats, and the stage's criterion becomes "
                        "the mean of the two held-out KLs")
    p.add_argument("--heldout-rows", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--patience", type=int, default=2,
                   help="epochs without a better held-out KL before the stage stops")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop (resumably) after this much wall time")
    p.add_argument("--teacher", default=None, metavar="DIR",
                   help="the teacher cache (default WORK/teacher); another stage's (its "
                        "WORK/teacher) to train on its windows without a teacher pass: its "
                        "plan and model must be this command's, else the command stops")
    p.add_argument("--indexer-types", default="", metavar="PATTERN",
                   help="train for reuse across layers: freqN (layers 0, N, 2N, ... keep an "
                        "indexer) or an F/S string per layer; each kept indexer learns its "
                        "own layer's target and those of the layers reusing its selection, "
                        "and the stage's dsa.json serves the pattern (the teacher cache is "
                        "the same as without it)")
    add_runtime_arguments(p)
    args = p.parse_args(argv)
    if args.windows < 1 or args.epochs < 1:
        p.error("--windows and --epochs must be >= 1")
    try:
        plan = WindowPlan(length=args.seq_len, rows=args.rows, first_row=args.first_row,
                          repeat_share=args.repeat_share, spans=args.spans,
                          span_tokens=parse_token_range(args.span_tokens, "--span-tokens"),
                          copy_distance=args.copy_distance and parse_token_range(
                              args.copy_distance, "--copy-distance"),
                          copy_rows=args.copy_rows, seed=args.seed)
    except ValueError as e:
        p.error(str(e))
    if not 1 <= args.heldout_rows <= args.seq_len:
        p.error(f"--heldout-rows must be in [1, --seq-len = {args.seq_len}], got "
                f"{args.heldout_rows}")
    enable_compile_cache()
    t0 = time.monotonic()
    out = pathlib.Path(args.out)
    work = pathlib.Path(args.work) if args.work else out.with_name(out.name + ".work")
    over = lambda: args.time_budget_s and time.monotonic() - t0 > args.time_budget_s  # noqa

    pre = load_pretrained(args.model, indexer_dir=None, seed=args.seed, attention="dense")
    model, tok = pre.model, pre.tokenizer
    full = None
    if args.indexer_types:  # the teacher reads every layer; the shared layers' indexers go
        try:
            model = with_config(model, model.config.replace(
                indexer_types=reuse_types(args.indexer_types)))
        except ValueError as e:
            p.error(f"--indexer-types: {e}")
        cached = full_layers(pre.model.config)  # what the teacher keeps, in layer order
        full = [cached.index(layer) for layer in full_layers(model.config)]
    record = open_stage(work, work / "last", model, args.init,
                        dict(epoch=0, step=0, train=[], heldout=[], tokens=0, teacher_s=0.0,
                             train_s=0.0, best=None))
    record["seq_len"] = args.seq_len
    record["title"] = (f"{args.model}: retrofit on a teacher cache, {args.seq_len}-token "
                       f"windows, {platform.machine()} {jax.devices()[0].platform}")

    # ---- 1. the teacher cache
    cache_key = dict(
        plan=dataclasses.asdict(plan), windows=args.windows, heldout_rows=args.heldout_rows,
        heldout_offset=HELDOUT_OFFSET, model_file=pathlib.Path(pre.info["path"]).name,
        model_sha256=file_sha256(pre.info["path"]))
    try:
        cache = TeacherCache(args.teacher or work / "teacher", cache_key,
                             shared=args.teacher is not None)
    except ValueError as e:
        p.error(f"--teacher: {e}")
    train_names, _ = split_documents(list_documents())
    stream = token_stream(tok, train_names, cache=cache_dir() / "corpus")

    held_names = [HELDOUT, HELDOUT_COPY] if plan.copy_rows > 0 else [HELDOUT]

    def planned():
        held = heldout_text_tokens(tok)[HELDOUT_OFFSET:HELDOUT_OFFSET + args.seq_len]
        yield HELDOUT, held, stratified_rows(args.seq_len, args.heldout_rows,
                                              seed=args.seed + 1_000_003), dict(repeats=[])
        if plan.copy_rows > 0:  # the same text with the plan's repeats, rows in the copies
            held, placed = repeat_spans(held, np.random.default_rng([args.seed, 37]),
                                        spans=plan.spans, span_tokens=plan.span_tokens,
                                        distance=plan.copy_distance)
            yield HELDOUT_COPY, held, window_rows(plan, held, placed, seed=args.seed + 37,
                                                  count=args.heldout_rows), dict(repeats=placed)
        for i in range(args.windows):
            tokens, meta = training_window(stream, plan, i)
            rows = window_rows(plan, tokens, meta["repeats"], seed=args.seed * 1_000_003 + i)
            yield f"window_{i:05d}", tokens, rows, meta

    teacher = make_teacher(pre.model)
    for item in planned():
        record["teacher_s"] += fill(cache, teacher, [item], log=print)
        if over():
            break
    names = [f"window_{i:05d}" for i in range(args.windows)]
    missing = [n for n in [*held_names, *names] if not cache.has(n)]
    if missing:
        (work / "record.json").write_text(json.dumps(record))
        save_indexer_weights(work / "last", model, base={})
        print(f"stopped by the time budget with {len(missing)} teacher windows to go; rerun "
              f"the same command to continue from {work}")
        return
    cache_gb = sum(cache.nbytes(n) for n in names) / 1e9
    del teacher
    jax.clear_caches()

    # ---- 2. train the indexers on the cache
    graphdef, trainable, frozen, rest, opt_state, step_fn, eval_fn = indexer_optimization(
        model, "indexer_cached", work)
    held = [window_arrays(cache.read(n), full) for n in held_names]

    def heldout_kl():
        """The stage's criterion: the mean KL over the held-out windows (each one's in
        record["heldout_parts"])."""
        parts = [float(eval_fn(trainable, frozen, rest, h)) for h in held]
        record.setdefault("heldout_parts", []).append([record["step"], parts])
        return float(np.mean(parts))

    total = args.epochs * args.windows
    n_params = sum(x.size for x in jax.tree.leaves(trainable))

    def model_now():
        return ts.merge_stage(graphdef, "indexer_cached", trainable, frozen, rest)

    if not record["heldout"]:
        record["heldout"].append([0, heldout_kl()])
        record["best"] = [0, record["heldout"][-1][1]]
        save_indexer_weights(work / "best", model_now(), base={})
        print(f"held-out KL ({args.heldout_rows} rows) before training: "
              f"{record['heldout'][-1][1]:.4f}")
    stopped = "epochs"
    while record["epoch"] < args.epochs:
        if record["epoch"] - record["best"][0] // args.windows >= args.patience:
            stopped = "patience"
            break
        if over():
            stopped = "time budget"
            break
        epoch = record["epoch"]
        order = np.random.default_rng([args.seed, 31, epoch]).permutation(args.windows)
        start = time.monotonic()
        for i in track(order, f"epoch {epoch + 1}/{args.epochs}"):
            entry = cache.read(names[i])
            lr = float(ts.lr_schedule(record["step"], total, peak=args.lr,
                                      warmup=args.warmup_steps, final_frac=0.1))
            trainable, opt_state, metrics = step_fn(trainable, opt_state, frozen, rest,
                                                    window_arrays(entry, full), lr)
            kl = float(metrics["loss"])
            if not math.isfinite(kl):
                raise FloatingPointError(f"KL is {kl} at step {record['step'] + 1}")
            record["step"] += 1
            record["tokens"] += args.seq_len
            record["train"].append([record["step"], round(kl, 5)])
        record["train_s"] += time.monotonic() - start
        record["epoch"] += 1
        kl = heldout_kl()
        record["heldout"].append([record["step"], kl])
        better = kl < record["best"][1]
        if better:
            record["best"] = [record["step"], kl]
            save_indexer_weights(work / "best", model_now(), base={})
        save_indexer_weights(work / "last", model_now(), base={})
        np.savez(work / "opt.npz", **_flat_opt(opt_state))
        (work / "record.json").write_text(json.dumps(record))
        print(f"epoch {record['epoch']}: held-out KL {kl:.4f}"
                   + (" (best)" if better else f" (best {record['best'][1]:.4f})"))
    if stopped == "time budget":
        print(f"stopped by the time budget after epoch {record['epoch']}; rerun the same "
              f"command to continue from {work}")
        return

    # ---- 3. ship the best epoch's indexer
    model = model_now()
    load_indexer_weights(work / "best", model)
    exact = {L: round(exact_heldout_kl(model, tok, L), 5) for L in sorted({2048, args.seq_len})}
    print(f"exact held-out KL (every query): {exact}")
    train_kl = [k for _, k in record["train"]]
    teacher_tokens = args.windows * args.seq_len
    summary = dict(
        command=recorded_command("experiments.training.retrofit", argv),
        recipe="teacher cache", steps=record["step"], seq_len=args.seq_len,
        tokens=record["tokens"], teacher_tokens=teacher_tokens,
        wall_s=round(record["teacher_s"] + record["train_s"], 1),
        teacher_s=round(record["teacher_s"], 1), train_s=round(record["train_s"], 1),
        cost_s_per_million_teacher_tokens=round(
            (record["teacher_s"] + record["train_s"]) / teacher_tokens * 1e6, 1),
        cache_gb=round(cache_gb, 2), windows=args.windows, rows=args.rows,
        repeat_share=args.repeat_share, epochs=record["epoch"], stopped_by=stopped,
        best_step=record["best"][0],
        hardware=f"{platform.machine()}, {jax.devices()[0].device_kind}",
        trainable_params=n_params, lr=args.lr,
        train_kl_first10=round(float(np.mean(train_kl[:10])), 4),
        train_kl_last10=round(float(np.mean(train_kl[-10:])), 4),
        heldout_kl=record["heldout"], heldout_kl_note=f"{args.heldout_rows} stratified rows" + (
            f"; mean of the pydoc window and the same window with repeats ({HELDOUT_COPY}, "
            f"{args.copy_rows:g} of its rows in the copies)" if args.copy_rows > 0 else ""),
        heldout_kl_parts=record.get("heldout_parts"), copy_rows=args.copy_rows,
        spans=args.spans, span_tokens=list(plan.span_tokens),
        copy_distance=plan.copy_distance and list(plan.copy_distance),
        heldout_kl_exact=exact, indexer_types=args.indexer_types or None,
        teacher_cache=args.teacher)
    ship_stage(out, model, args, pre, summary, record)
    print(json.dumps({k: v for k, v in summary.items() if k != "heldout_kl"}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
