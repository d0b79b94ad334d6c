"""What a training run records besides its weights: formats, the training log, the shipped
checkpoint's metadata, the command that reproduces the run, the tar; resume checkpoints
(weights, the run's position and the optimizer state); log formatting."""

import copy
import platform
import sys
import tarfile

import jax
from flax import nnx

from experiments.common import display_path
from experiments.training import steps as ts
from model.checkpoint import read_config, restore_checkpoint, save_checkpoint
from model.transformer import Transformer

LOG_FORMAT = "dosa-train-log-v1"
CHECKPOINT_FORMAT = "dosa-train-v1"
LONG_CONTEXT_NOTE = (
    "Small RoPE base (rope_theta in the stored config): every rotary frequency completes a "
    "full period within the 2K training window, so contexts of 8K-64K produce no unseen "
    "rotary angles; evaluate with rope_scaling = 1 (linear position interpolation without "
    "fine-tuning measured far worse). A short dense_long stage on longer windows (when run) "
    "teaches attention to ignore the extra distractors of long contexts.")


def flatten_tree(tree):
    return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def unflatten_tree(like, flat):
    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, [flat[str(i)] for i in range(treedef.num_leaves)])


def save_resume(work_dir, model, opt_state, state):
    """A resume checkpoint in work_dir: the weights, the run's position `state` and, inside
    a stage, the optimizer state (None at a stage end)."""
    save_checkpoint(work_dir, model, step=state["global_step"],
                    metadata=dict(format=CHECKPOINT_FORMAT, resume=state),
                    extra=None if opt_state is None else {"opt_state": flatten_tree(opt_state)},
                    max_to_keep=2)


def read_resume_state(work_dir):
    """The run's position recorded in work_dir's resume checkpoint, or None (none there)."""
    try:
        _, meta = read_config(work_dir)
    except FileNotFoundError:
        return None
    return meta.get("resume") or None


def restore_resume(work_dir, config, stage=None, tx=None):
    """The weights of work_dir's resume checkpoint as a Transformer(config) and, when a
    stage is given, that stage's flat optimizer state (optimizer tx) -> (model, flat or
    None)."""
    extra_target = None
    if stage is not None:
        _, main, idx, _ = ts.split_model(Transformer(config, rngs=nnx.Rngs(0)))
        trainable, _ = ts.trainable_of(stage, main, idx)
        abstract = jax.eval_shape(tx.init, trainable)
        extra_target = {"opt_state": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), flatten_tree(abstract))}
    model, _, extra = restore_checkpoint(work_dir, config, extra_target=extra_target)
    return model, None if extra is None else extra["opt_state"]


def shipped_config(train_config):
    """The config stored with the final weights: float32 compute, the preset's run-time
    defaults (sparse attention, flat indexer) so the default load is the DSA model."""
    return train_config.replace(dtype="float32", attention="sparse", indexer="flat")


def device_description():
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')} x{jax.device_count()}"


def fmt_tokens(n):
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


class Log:
    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def __call__(self, msg):
        print(msg, file=self.stream, flush=True)


def run_banner(corpus, out_dir, work_dir):
    """The run's first log line: machine, versions, corpus, directories."""
    return (f"dosa train: device {device_description()}, jax {jax.__version__}, python "
            f"{platform.python_version()}; corpus {len(corpus.train_files)} train / "
            f"{len(corpus.heldout_files)} held-out files, "
            f"{fmt_tokens(corpus.train_tokens.shape[0])} train tokens; out {out_dir}; work "
            f"{work_dir}")


def reproduce_command(stage_names, state, cli_args):
    """The command line that replays the run: its schedule lengths (--steps), the steps
    done where a stage stopped early (--stop), and the --set overrides."""
    stages = state["stages"]
    steps = ",".join(f"{n}={stages[n]['schedule_steps']}" for n in stage_names)
    stops = [f"{n}={stages[n]['steps_done']}" for n in stage_names
             if stages[n]["steps_done"] < stages[n]["schedule_steps"]]
    cmd = ["python", "-m", "experiments.training.train", "--config",
           str(cli_args.get("config")), "--out", "DIR", "--steps", steps]
    if stops:
        cmd += ["--stop", ",".join(stops)]
    for item in cli_args.get("set") or []:
        cmd += ["--set", item]
    return " ".join(cmd)


def training_log(cfg, stage_names, state, *, wall, time_budget_s, cli_args):
    """The run's log (training_log.json): per-stage records, totals, the config as a dict."""
    stages = {}
    for name in stage_names:
        rec = {k: v for k, v in state["stages"][name].items() if k != "opt_state_flat"}
        rec["tokens_per_s"] = round(rec["tokens"] / max(rec.get("wall_s", 0.0), 1e-9), 1)
        stages[name] = rec
    return dict(format=LOG_FORMAT, device=device_description(), jax_version=jax.__version__,
                python_version=platform.python_version(), total_steps=state["global_step"],
                tokens_seen=state["tokens_seen"], wall_time_s=round(wall, 2),
                time_budget_s=time_budget_s, stages=stages,
                reproduce=reproduce_command(stage_names, state, cli_args),
                config=cfg.to_dict())


def shipped_metadata(cfg, log, *, data, ship_config, init_from=None, parent=None):
    """The shipped checkpoint's metadata: data split, training record (log points
    dropped), the config, long-context method; with init_from, the parent's lineage (its
    long-context record is the one that holds)."""
    seq_len = cfg.data.seq_len
    metadata = dict(format=CHECKPOINT_FORMAT, data=data, seq_len=seq_len,
                    long_context=dict(method="small_rope_base+length_curriculum",
                                      rope_theta=ship_config.rope_theta, train_len=seq_len,
                                      eval_rope_scaling=1.0,
                                      stage_seq_lens={n: rec.get("seq_len")
                                                      for n, rec in log["stages"].items()},
                                      note=LONG_CONTEXT_NOTE),
                    training=copy.deepcopy({k: v for k, v in log.items() if k != "config"}),
                    train_config=cfg.to_dict())
    if parent is not None:
        meta = parent["metadata"]
        metadata["init_from"] = dict(
            path=display_path(init_from), training=meta.get("training"),
            train_config=meta.get("train_config"), init_from=meta.get("init_from"))
        metadata["long_context"] = meta.get("long_context", metadata["long_context"])
    for rec in metadata["training"]["stages"].values():
        rec.pop("history", None)
    return metadata


def write_tar(tar_path, directory, log_text):
    """`directory` as one tar file, with the log beside it -> the tar's size in bytes."""
    tar_path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path, "w") as tar:
        tar.add(directory, arcname=directory.name)
    (tar_path.parent / "training_log.json").write_text(log_text)
    return tar_path.stat().st_size


def summary_line(log, wall):
    parts = []
    for name, r in log["stages"].items():
        parts.append(f"{name}: steps {r['steps_done']} ({r.get('stopped_by')}) start_loss "
                     f"{r.get('start_loss')} end_loss {r.get('end_loss')} tokens "
                     f"{r['tokens']} wall {r.get('wall_s', 0.0):.1f}s")
    return "SUMMARY " + " | ".join(parts) + f" | total wall {wall:.1f}s"
