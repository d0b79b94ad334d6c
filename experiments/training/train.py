"""Train the byte-level DSA model on the Python standard library.

    python -m experiments.training.train --config experiments/configs/train_small.yaml --out DIR \
        [--time-budget-s S] [--steps dense=N,indexer_warmup=M] [--set a.b=value ...] \
        [--work-dir W] [--tar FILE] [--overwrite]

Stages (experiments/training/steps.py): "dense" pretraining, "dense_long" (the same on longer
windows: a short length curriculum), then "indexer_warmup" (the DeepSeek-V3.2 indexer
warm-up: main model frozen, KL to the head-summed attention). A stage may set its own
seq_len and micro_batches; steps: 0 skips it. The YAML's keys, defaults and checks:
experiments/training/config.py (TrainingConfig). A top-level `init_from: DIR` starts from that
checkpoint's weights and architecture instead of a random initialisation (e.g.
experiments/configs/indexer_rewarm.yaml: the indexer warm-up again on trained weights).

Outputs
- DIR: the shipped checkpoint (orbax, via model.checkpoint.save_checkpoint): float32 weights,
  the ModelConfig and metadata (data split, Python version, steps done per stage, the command
  that reproduces the run). No optimizer state: it stays in the work dir.
- DIR/training_log.json (and beside --tar): per-stage start/end loss, tokens, wall time, log
  points.
- W (default DIR + ".work"): resume checkpoints, weights + optimizer state + position, every
  `save_every` steps and at each stage end. Rerunning the same command resumes from there and
  continues the step count; the data position is the step (batches are a pure function of
  seed, stage and step), so a resumed run replays exactly what an uninterrupted one would.

Time budget: with --time-budget-s S (measured from the start of main, compile included),
stage i may use share_i of S minus `final_reserve_s`. After a few timed steps its schedule
length is cut to the steps that fit (min(steps, estimate)); the steps actually done and the
schedule length are recorded, and `--steps` with those numbers reproduces the same run on any
machine (e.g. a CPU, in hours).
"""

import argparse
import copy
import json
import math
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.data import Corpus, sample_batch
from experiments.training import records
from experiments.training import steps as ts
from experiments.training.config import (
    TrainingConfig,
    init_source,
    load_config,
    model_config,
    parse_stage_ints,
)
from experiments.training.records import Log, fmt_tokens
from model.checkpoint import restore_checkpoint, save_checkpoint
from model.transformer import Transformer

# Seed streams of the batches (experiments.data.sample_batch): one per stage, one held out.
STAGE_SEED_STREAM = {"dense": 1, "indexer_warmup": 2, "dense_long": 3}
HELDOUT_SEED_STREAM = 1000


# ------------------------------------------------------------------------ trainer

def make_optimizer(stage):
    """The optimizer of a StageConfig."""
    return ts.make_optimizer(weight_decay=stage.weight_decay, clip=stage.clip)


class Trainer:
    """A run of the configured stages (cfg: a TrainingConfig, or its dict) into out_dir,
    resumable from work_dir."""

    def __init__(self, cfg, out_dir, *, work_dir=None, time_budget_s=None, steps=None,
                 stops=None, run_steps=None, cli_args=None, log=None, start_time=None):
        self.t0 = time.monotonic() if start_time is None else start_time
        if not isinstance(cfg, TrainingConfig):
            cfg = TrainingConfig.from_dict(cfg)
        self.cfg = cfg
        self.out_dir = pathlib.Path(out_dir).resolve()
        self.work_dir = (pathlib.Path(work_dir) if work_dir else
                         self.out_dir.with_name(self.out_dir.name + ".work")).resolve()
        self.time_budget_s = time_budget_s
        self.steps_override = steps or {}
        self.stops = stops or {}
        self.run_steps_left = run_steps  # None: no limit on steps in this invocation
        self.cli_args = cli_args or {}
        self.log = log or Log()
        self.seed = cfg.seed
        self.train_cfg = cfg.train
        if self.train_cfg.matmul_precision:
            jax.config.update("jax_default_matmul_precision", self.train_cfg.matmul_precision)
        self.init_from, self.parent = init_source(cfg)
        if self.parent is not None:  # the parent's architecture, with the YAML's overrides
            self.config = self.parent["config"].replace(**cfg.model.overrides)
        else:
            self.config = model_config(cfg)
        # Training runs dense attention: the LM loss, and the indexer warm-up's KL target.
        self.config = self.config.replace(attention="dense")
        self.seq_len = cfg.data.seq_len
        seq_lens = {"data": self.seq_len, **{f"stages.{n}": cfg.stage_seq_len(s)
                                             for n, s in cfg.stage_list()}}
        for where, seq_len in seq_lens.items():
            if seq_len > self.config.max_seq_len:
                raise ValueError(f"{where}.seq_len {seq_len} > max_seq_len "
                                 f"{self.config.max_seq_len}")
        self.corpus = Corpus(heldout_fraction=cfg.data.heldout_fraction,
                             max_files=cfg.data.max_files)
        self.stages = cfg.stage_list()

    # ---- time budget
    def stage_deadline(self, index):
        """Stage `index` gets its share of the budget still left when it starts (so a
        stage that overran, e.g. by compiling, does not starve the next one)."""
        if self.time_budget_s is None:
            return math.inf
        end = self.t0 + self.time_budget_s - self.train_cfg.final_reserve_s
        shares = [s.budget_share if self.configured_steps(n, s) > 0 else 0.0
                  for n, s in self.stages]
        left = sum(shares[index:]) or 1.0
        now = time.monotonic()
        return now + max(0.0, end - now) * shares[index] / left

    def configured_steps(self, name, settings):
        return int(self.steps_override.get(name, settings.steps))

    def save_resume(self, model, opt_state, state):
        records.save_resume(self.work_dir, model, opt_state, state)

    # ---- one stage
    def run_stage(self, index, model, state):
        name, s = self.stages[index]
        rec = state["stages"][name]
        batch_size = s.batch_size
        seq_len = self.cfg.stage_seq_len(s)
        micro_batches = self.cfg.stage_micro_batches(s)
        steps_cfg = self.configured_steps(name, s)
        tokens_per_step = batch_size * seq_len
        tx = make_optimizer(s)
        graphdef, main, idx, rest = ts.split_model(model)
        trainable, frozen = ts.trainable_of(name, main, idx)
        opt_state = tx.init(trainable)
        if rec.get("opt_state_flat") is not None:
            opt_state = records.unflatten_tree(opt_state, rec.pop("opt_state_flat"))
        step_fn = ts.make_train_step(graphdef, name, tx, micro_batches=micro_batches,
                                     remat=s.remat)
        peak, warmup, final_frac = s.lr, s.warmup_steps, s.final_lr_frac
        lr_fn = jax.jit(lambda st, tot: ts.lr_schedule(st, tot, peak=peak, warmup=warmup,
                                                       final_frac=final_frac))
        if rec.get("schedule_steps") is None:
            rec["schedule_steps"] = steps_cfg
        if rec["schedule_steps"] == 0:
            rec.update(complete=True, stopped_by="skipped", wall_s=0.0)
            self.log(f"[{name}] skipped (0 steps)")
            return model
        stop_at = self.stops.get(name)
        deadline = self.stage_deadline(index)
        log_every = self.train_cfg.log_every
        save_every = self.train_cfg.save_every
        tokens = self.corpus.train_tokens
        stream = STAGE_SEED_STREAM[name]
        estimate_at = None if (self.time_budget_s is None or rec["steps_done"] > 0) else 2
        probe_steps = 5
        self.log(f"[{name}] stage {index + 1}/{len(self.stages)}: steps "
                 f"{rec['steps_done']}/{rec['schedule_steps']}, batch {batch_size} x "
                 f"{seq_len} tokens ({micro_batches} micro-batches), lr {peak:g}, trainable params "
                 f"{sum(x.size for x in jax.tree.leaves(trainable)):,}")

        stage_start = time.monotonic()
        window_start, window_steps = time.monotonic(), 0
        probe_start = None
        pending = None  # (step index, metrics) of the last dispatched step
        losses_tail = []

        def finish(pending):
            nonlocal window_start, window_steps
            i, metrics, global_step = pending
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                raise FloatingPointError(f"[{name}] loss is {loss} at stage step {i + 1}")
            if rec.get("start_loss") is None:
                rec["start_loss"] = round(loss, 5)
            losses_tail.append(loss)
            del losses_tail[:-log_every]
            rec["last_loss"] = loss
            window_steps += 1
            done = i + 1
            if done % log_every == 0 or done == rec["schedule_steps"]:
                now = time.monotonic()
                tps = window_steps * tokens_per_step / max(now - window_start, 1e-9)
                lr = float(lr_fn(i, rec["schedule_steps"]))
                rec["history"].append([done, round(float(np.mean(losses_tail)), 5)])
                self.log(f"[{name}] step {done}/{rec['schedule_steps']} (global "
                         f"{global_step}) loss {np.mean(losses_tail):.4f} lr {lr:.2e} "
                         f"gnorm {float(metrics['grad_norm']):.3f} tok/s {fmt_tokens(tps)} "
                         f"elapsed {now - self.t0:.0f}s")
                window_start, window_steps = now, 0

        stopped_by = "steps"
        while rec["steps_done"] < rec["schedule_steps"]:
            i = rec["steps_done"]
            if stop_at is not None and i >= stop_at:
                stopped_by = "stop"
                break
            if time.monotonic() > deadline and pending is not None:  # >= 1 step per run
                stopped_by = "time"
                break
            if self.run_steps_left is not None:
                if self.run_steps_left <= 0:
                    stopped_by = "paused"
                    break
                self.run_steps_left -= 1
            batch = jnp.asarray(sample_batch(tokens, batch_size, seq_len, seed=self.seed,
                                             stream=stream, step=i))
            lr = lr_fn(i, rec["schedule_steps"])
            trainable, opt_state, metrics = step_fn(trainable, opt_state, frozen, rest, batch, lr)
            rec["steps_done"] = i + 1
            rec["tokens"] += tokens_per_step
            state["global_step"] += 1
            state["tokens_seen"] += tokens_per_step
            if pending is not None:
                finish(pending)
            pending = (i, metrics, state["global_step"])
            if estimate_at is not None and rec["steps_done"] == estimate_at:
                jax.block_until_ready(metrics["loss"])
                probe_start = time.monotonic()
            elif probe_start is not None and rec["steps_done"] == estimate_at + probe_steps:
                jax.block_until_ready(metrics["loss"])
                per_step = (time.monotonic() - probe_start) / probe_steps
                fit = int((deadline - time.monotonic()) / per_step * 0.97)
                new_total = max(rec["steps_done"], min(rec["schedule_steps"],
                                                       rec["steps_done"] + fit))
                self.log(f"[{name}] {per_step * 1e3:.1f} ms/step "
                         f"({fmt_tokens(tokens_per_step / per_step)} tok/s); time budget "
                         f"fits {rec['steps_done'] + fit} steps -> schedule "
                         f"{new_total} steps")
                rec["schedule_steps"] = new_total
                rec["ms_per_step"] = round(per_step * 1e3, 3)
                probe_start = None
            if save_every and rec["steps_done"] % save_every == 0 \
                    and rec["steps_done"] < rec["schedule_steps"]:
                if pending is not None:
                    finish(pending)
                    pending = None
                model = ts.merge_stage(graphdef, name, trainable, frozen, rest)
                self.save_resume(model, opt_state, state)
        if pending is not None:
            finish(pending)
        rec["wall_s"] = rec.get("wall_s", 0.0) + (time.monotonic() - stage_start)
        if stopped_by == "paused":
            model = ts.merge_stage(graphdef, name, trainable, frozen, rest)
            self.save_resume(model, opt_state, state)
            self.log(f"[{name}] paused at stage step {rec['steps_done']} (global "
                     f"{state['global_step']}): resume checkpoint in {self.work_dir}; rerun the "
                     "same command to continue")
            return None
        rec["stopped_by"] = stopped_by
        if losses_tail:
            rec["end_loss"] = round(float(np.mean(losses_tail)), 5)
        rec["complete"] = True
        model = ts.merge_stage(graphdef, name, trainable, frozen, rest)
        rec["seq_len"] = seq_len
        rec["heldout"] = self.heldout_eval(name, model, batch_size // micro_batches, seq_len)
        self.save_resume(model, None, state)
        tps = rec["tokens"] / max(rec["wall_s"], 1e-9)
        self.log(f"[{name}] done: {rec['steps_done']} steps ({stopped_by}), loss "
                 f"{rec['start_loss']} -> {rec['end_loss']}, {fmt_tokens(rec['tokens'])} tokens, "
                 f"{rec['wall_s']:.1f}s ({fmt_tokens(tps)} tok/s incl. compile), held-out "
                 f"{rec['heldout']}")
        return model

    def heldout_eval(self, name, model, batch_size, seq_len):
        n = self.train_cfg.eval_batches
        if n <= 0:
            return None
        graphdef, main, idx, rest = ts.split_model(model)
        trainable, frozen = ts.trainable_of(name, main, idx)
        evaluate = ts.make_eval_loss(graphdef, name)
        vals = []
        for b in range(n):
            batch = sample_batch(self.corpus.heldout_tokens, batch_size, seq_len,
                                 seed=self.seed, stream=HELDOUT_SEED_STREAM, step=b)
            vals.append(float(evaluate(trainable, frozen, rest, jnp.asarray(batch))))
        value = float(np.mean(vals))
        if name in ts.LM_STAGES:
            return {"loss_nats": round(value, 5), "bits_per_byte": round(value / ts.LN2, 5),
                    "tokens": n * batch_size * seq_len, "seq_len": seq_len}
        return {"kl": round(value, 5), "tokens": n * batch_size * seq_len, "seq_len": seq_len}

    # ---- whole run
    def run(self):
        self.log(records.run_banner(self.corpus, self.out_dir, self.work_dir))
        state = records.read_resume_state(self.work_dir)
        if state is not None:
            state = copy.deepcopy(state)
            current = next((n for n, _ in self.stages
                            if not state["stages"].get(n, {}).get("complete")), None)
            if current is not None and state["stages"][current]["steps_done"] > 0:
                model, opt_flat = records.restore_resume(
                    self.work_dir, self.config, current, make_optimizer(dict(self.stages)[current]))
                state["stages"][current]["opt_state_flat"] = opt_flat
            else:
                model, _ = records.restore_resume(self.work_dir, self.config)
            self.log(f"resumed from {self.work_dir} at global step {state['global_step']}")
        elif self.parent is not None:
            model, _, _ = restore_checkpoint(self.init_from, self.config)
            done = self.parent["metadata"].get("training", {})
            # The step count continues the parent's.
            state = dict(global_step=int(done.get("total_steps", 0)),
                         tokens_seen=int(done.get("tokens_seen", 0)), stages={})
            self.log(f"initialised from {self.init_from} (step {state['global_step']})")
        else:
            model = Transformer(self.config, rngs=nnx.Rngs(self.seed))
            state = dict(global_step=0, tokens_seen=0, stages={})
        for name, _ in self.stages:
            state["stages"].setdefault(name, dict(steps_done=0, tokens=0, history=[],
                                                  schedule_steps=None, start_loss=None,
                                                  complete=False))
            if name in self.steps_override and not state["stages"][name]["complete"] \
                    and state["stages"][name]["steps_done"] == 0:
                state["stages"][name]["schedule_steps"] = None
        for index, (name, _) in enumerate(self.stages):
            if state["stages"][name]["complete"]:
                continue
            model = self.run_stage(index, model, state)
            if model is None:
                return None
        return self.finish(model, state)

    def finish(self, model, state):
        wall = time.monotonic() - self.t0
        names = [n for n, _ in self.stages]
        log = records.training_log(self.cfg, names, state, wall=wall,
                                   time_budget_s=self.time_budget_s, cli_args=self.cli_args)
        ship_cfg = records.shipped_config(self.config)
        shipped = Transformer(ship_cfg, rngs=nnx.Rngs(0))
        nnx.update(shipped, jax.tree.map(lambda x: x.astype(jnp.float32),
                                         nnx.state(model, nnx.Param)))
        metadata = records.shipped_metadata(self.cfg, log, data=self.corpus.describe(),
                                            ship_config=ship_cfg, init_from=self.init_from,
                                            parent=self.parent)
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        save_checkpoint(self.out_dir, shipped, step=state["global_step"], metadata=metadata)
        log_text = json.dumps(log, indent=1, sort_keys=True)
        (self.out_dir / "training_log.json").write_text(log_text)
        if self.cli_args.get("tar"):
            tar_path = pathlib.Path(self.cli_args["tar"])
            size = records.write_tar(tar_path, self.out_dir, log_text)
            self.log(f"wrote {tar_path} ({size / 2**20:.1f} MiB)"
                     + ("  WARNING: over 16 MiB" if size > 16 * 2**20 else ""))
        self.log(f"wrote checkpoint {self.out_dir} (step {state['global_step']})")
        self.log(f"reproduce: {log['reproduce']}")
        self.log(records.summary_line(log, wall))
        return log


def main(argv=None):
    start = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML file (experiments/configs/...)")
    p.add_argument("--out", required=True, help="directory of the final (shipped) checkpoint")
    p.add_argument("--work-dir", default=None,
                   help="resume checkpoints with optimizer state (default: OUT.work)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-clock budget for the whole run, compile included")
    p.add_argument("--steps", default="", help="schedule length per stage, e.g. dense=4000,"
                   "indexer_warmup=500 (overrides the YAML; reproduces a budgeted run)")
    p.add_argument("--stop", default="", help="stop a stage early at this step (reproduces a "
                   "run cut by its time budget), e.g. dense=1234")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a YAML entry, e.g. --set stages.dense.batch_size=4")
    p.add_argument("--run-steps", type=int, default=None,
                   help="train at most this many steps in this invocation, then save a resume "
                   "checkpoint and exit (long CPU runs in pieces); rerun to continue")
    p.add_argument("--tar", default=None, help="also write the checkpoint as one tar file "
                   "(and training_log.json beside it)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT (otherwise refuse)")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        p.error(f"--out {out} exists and is not empty (use --overwrite)")
    try:
        cfg = load_config(args.config, args.set)
    except ValueError as e:  # an unknown key or a bad value, named
        p.error(f"--config {args.config}: {e}")
    trainer = Trainer(cfg, out, work_dir=args.work_dir, time_budget_s=args.time_budget_s,
                      steps=parse_stage_ints(args.steps, "--steps"),
                      stops=parse_stage_ints(args.stop, "--stop"), run_steps=args.run_steps,
                      cli_args=dict(config=args.config, set=args.set, tar=args.tar),
                      start_time=start)
    trainer.run()


if __name__ == "__main__":
    main()
