"""Train the byte-level DSA model on the Python standard library (issue 5).

    python -m experiments.train --config experiments/configs/train_small.yaml --out DIR \
        [--time-budget-s S] [--steps dense=N,indexer_warmup=M] [--set a.b=value ...] \
        [--work-dir W] [--tar FILE] [--overwrite]

Stages (experiments/training_steps.py): "dense" pretraining, "dense_long" (the same on longer
windows: a short length curriculum), then "indexer_warmup" (the DeepSeek-V3.2 indexer
warm-up: main model frozen, KL to the head-summed attention). A stage may set its own
seq_len and micro_batches; steps: 0 skips it. A top-level `init_from: DIR` starts from that
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
import platform
import shutil
import tarfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import training_steps as ts
from experiments.data import Corpus, sample_batch
from experiments.train_config import (CHECKPOINT_FORMAT, HELDOUT_SEED_STREAM, LOG_FORMAT,
                                      LONG_CONTEXT_NOTE, STAGE_SEED_STREAM, Log,
                                      device_description, flatten_tree, fmt_tokens, init_source,
                                      load_config,
                                      model_config, parse_stage_ints, shipped_config, stage_list,
                                      unflatten_tree)
from model.checkpoint import read_config, restore_checkpoint, save_checkpoint
from model.transformer import Transformer


# ------------------------------------------------------------------------ trainer

class Trainer:
    def __init__(self, cfg, out_dir, *, work_dir=None, time_budget_s=None, steps=None,
                 stops=None, run_steps=None, cli_args=None, log=None, start_time=None):
        self.t0 = time.monotonic() if start_time is None else start_time
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
        self.seed = int(cfg.get("seed", 0))
        self.train_cfg = cfg.get("train") or {}
        precision = self.train_cfg.get("matmul_precision")
        if precision:
            jax.config.update("jax_default_matmul_precision", precision)
        self.init_from, self.parent = init_source(cfg)
        if self.parent is not None:  # the parent's architecture, with the YAML's overrides
            stored = self.parent["config"]
            self.config = stored.replace(**((cfg.get("model") or {}).get("overrides") or {}))
        else:
            self.config = model_config(cfg)
        self.config = self.config.replace(attention="dense")
        data = cfg.get("data") or {}
        self.seq_len = int(data.get("seq_len", 2048))
        if self.seq_len > self.config.max_seq_len:
            raise ValueError(f"data.seq_len {self.seq_len} > max_seq_len {self.config.max_seq_len}")
        self.corpus = Corpus(heldout_fraction=float(data.get("heldout_fraction", 0.05)),
                             max_files=data.get("max_files"))
        self.stages = stage_list(cfg)

    # ---- time budget
    def stage_deadline(self, index):
        """Stage `index` gets its share of the budget still left when it starts (so a
        stage that overran, e.g. by compiling, does not starve the next one)."""
        if self.time_budget_s is None:
            return math.inf
        end = self.t0 + self.time_budget_s - float(self.train_cfg.get("final_reserve_s", 20))
        shares = [float(s.get("budget_share", 1.0)) if self.configured_steps(n, s) > 0 else 0.0
                  for n, s in self.stages]
        left = sum(shares[index:]) or 1.0
        now = time.monotonic()
        return now + max(0.0, end - now) * shares[index] / left

    def configured_steps(self, name, settings):
        return int(self.steps_override.get(name, settings.get("steps", 0)))

    # ---- checkpoints
    def save_resume(self, model, opt_state, state):
        save_checkpoint(self.work_dir, model, step=state["global_step"],
                        metadata=dict(format=CHECKPOINT_FORMAT, resume=state),
                        extra=None if opt_state is None else {"opt_state": flatten_tree(opt_state)},
                        max_to_keep=2)

    def try_resume(self):
        """-> (model, resume state, flat optimizer state or None) or None."""
        try:
            stored, meta = read_config(self.work_dir)
        except FileNotFoundError:
            return None
        state = meta.get("resume")
        if not state:
            return None
        return stored, state

    # ---- one stage
    def run_stage(self, index, model, state):
        name, s = self.stages[index]
        rec = state["stages"][name]
        batch_size = int(s.get("batch_size", 8))
        seq_len = int(s.get("seq_len", self.seq_len))
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"stages.{name}.seq_len {seq_len} > max_seq_len "
                             f"{self.config.max_seq_len}")
        micro_batches = int(s.get("micro_batches", self.train_cfg.get("micro_batches", 1)))
        if batch_size % micro_batches:
            raise ValueError(f"stages.{name}: batch_size {batch_size} is not a multiple of "
                             f"micro_batches {micro_batches}")
        steps_cfg = self.configured_steps(name, s)
        tokens_per_step = batch_size * seq_len
        tx = ts.make_optimizer(weight_decay=float(s.get("weight_decay", 0.0)),
                               clip=float(s.get("clip", 1.0)))
        graphdef, main, idx, rest = ts.split_model(model)
        trainable, frozen = ts.trainable_of(name, main, idx)
        opt_state = tx.init(trainable)
        if rec.get("opt_state_flat") is not None:
            opt_state = unflatten_tree(opt_state, rec.pop("opt_state_flat"))
        step_fn = ts.make_train_step(graphdef, name, tx, micro_batches=micro_batches,
                                     remat=bool(s.get("remat", False)))
        peak, warmup = float(s.get("lr", 1e-3)), int(s.get("warmup_steps", 0))
        final_frac = float(s.get("final_lr_frac", 0.1))
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
        log_every = max(1, int(self.train_cfg.get("log_every", 20)))
        save_every = int(self.train_cfg.get("save_every", 0) or 0)
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
        n = int(self.train_cfg.get("eval_batches", 0) or 0)
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
        self.log(f"dosa train: device {device_description()}, jax {jax.__version__}, python "
                 f"{platform.python_version()}; corpus {len(self.corpus.train_files)} train / "
                 f"{len(self.corpus.heldout_files)} held-out files, "
                 f"{fmt_tokens(self.corpus.train_tokens.shape[0])} train tokens; out "
                 f"{self.out_dir}; work {self.work_dir}")
        resumed = self.try_resume()
        if resumed is not None:
            _, state = resumed
            state = copy.deepcopy(state)
            current = next((n for n, _ in self.stages
                            if not state["stages"].get(n, {}).get("complete")), None)
            extra_target = None
            if current is not None and state["stages"][current]["steps_done"] > 0:
                probe = Transformer(self.config, rngs=nnx.Rngs(0))
                _, main, idx, _ = ts.split_model(probe)
                tr, _ = ts.trainable_of(current, main, idx)
                s = dict(self.stages)[current]
                tx = ts.make_optimizer(weight_decay=float(s.get("weight_decay", 0.0)),
                                       clip=float(s.get("clip", 1.0)))
                abstract = jax.eval_shape(tx.init, tr)
                extra_target = {"opt_state": jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), flatten_tree(abstract))}
            model, _, extra = restore_checkpoint(self.work_dir, self.config,
                                                 extra_target=extra_target)
            if extra is not None:
                state["stages"][current]["opt_state_flat"] = extra["opt_state"]
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
        for name, s in self.stages:
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

    def reproduce_command(self, state):
        steps = ",".join(f"{n}={state['stages'][n]['schedule_steps']}" for n, _ in self.stages)
        stops = [f"{n}={state['stages'][n]['steps_done']}" for n, _ in self.stages
                 if state["stages"][n]["steps_done"] < state["stages"][n]["schedule_steps"]]
        cmd = ["python", "-m", "experiments.train", "--config", str(self.cli_args.get("config")),
               "--out", "DIR", "--steps", steps]
        if stops:
            cmd += ["--stop", ",".join(stops)]
        for item in self.cli_args.get("set") or []:
            cmd += ["--set", item]
        return " ".join(cmd)

    def training_log(self, state, wall):
        stages = {}
        for name, _ in self.stages:
            rec = {k: v for k, v in state["stages"][name].items() if k != "opt_state_flat"}
            rec["tokens_per_s"] = round(rec["tokens"] / max(rec.get("wall_s", 0.0), 1e-9), 1)
            stages[name] = rec
        return dict(format=LOG_FORMAT, device=device_description(), jax_version=jax.__version__,
                    python_version=platform.python_version(), total_steps=state["global_step"],
                    tokens_seen=state["tokens_seen"], wall_time_s=round(wall, 2),
                    time_budget_s=self.time_budget_s, stages=stages,
                    reproduce=self.reproduce_command(state), config=self.cfg)

    def finish(self, model, state):
        wall = time.monotonic() - self.t0
        log = self.training_log(state, wall)
        data_meta = self.corpus.describe()
        ship_cfg = shipped_config(self.config)
        shipped = Transformer(ship_cfg, rngs=nnx.Rngs(0))
        nnx.update(shipped, jax.tree.map(lambda x: x.astype(jnp.float32),
                                         nnx.state(model, nnx.Param)))
        metadata = dict(format=CHECKPOINT_FORMAT, data=data_meta, seq_len=self.seq_len,
                        long_context=dict(method="small_rope_base+length_curriculum",
                                          rope_theta=ship_cfg.rope_theta,
                                          train_len=self.seq_len, eval_rope_scaling=1.0,
                                          stage_seq_lens={n: log["stages"][n].get("seq_len")
                                                          for n, _ in self.stages},
                                          note=LONG_CONTEXT_NOTE),
                        training=copy.deepcopy({k: v for k, v in log.items()
                                                if k != "config"}),
                        train_config=self.cfg)
        if self.parent is not None:  # lineage: what the starting weights went through
            parent = self.parent["metadata"]
            metadata["init_from"] = dict(
                path=str(self.init_from), training=parent.get("training"),
                train_config=parent.get("train_config"), init_from=parent.get("init_from"))
            metadata["long_context"] = parent.get("long_context", metadata["long_context"])
        for rec in metadata["training"]["stages"].values():
            rec.pop("history", None)
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        save_checkpoint(self.out_dir, shipped, step=state["global_step"], metadata=metadata)
        log_text = json.dumps(log, indent=1, sort_keys=True)
        (self.out_dir / "training_log.json").write_text(log_text)
        tar_path = self.cli_args.get("tar")
        if tar_path:
            tar_path = pathlib.Path(tar_path)
            tar_path.parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(tar_path, "w") as tar:
                tar.add(self.out_dir, arcname=self.out_dir.name)
            (tar_path.parent / "training_log.json").write_text(log_text)
            size = tar_path.stat().st_size
            self.log(f"wrote {tar_path} ({size / 2**20:.1f} MiB)"
                     + ("  WARNING: over 16 MiB" if size > 16 * 2**20 else ""))
        parts = []
        for name, _ in self.stages:
            r = log["stages"][name]
            parts.append(f"{name}: steps {r['steps_done']} ({r.get('stopped_by')}) start_loss "
                         f"{r.get('start_loss')} end_loss {r.get('end_loss')} tokens "
                         f"{r['tokens']} wall {r.get('wall_s', 0.0):.1f}s")
        self.log(f"wrote checkpoint {self.out_dir} (step {state['global_step']})")
        self.log(f"reproduce: {log['reproduce']}")
        self.log("SUMMARY " + " | ".join(parts) + f" | total wall {wall:.1f}s")
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
    cfg = load_config(args.config, args.set)
    trainer = Trainer(cfg, out, work_dir=args.work_dir, time_budget_s=args.time_budget_s,
                      steps=parse_stage_ints(args.steps, "--steps"),
                      stops=parse_stage_ints(args.stop, "--stop"), run_steps=args.run_steps,
                      cli_args=dict(config=args.config, set=args.set, tar=args.tar),
                      start_time=start)
    trainer.run()


if __name__ == "__main__":
    main()
