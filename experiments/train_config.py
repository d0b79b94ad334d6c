"""Configuration and small helpers of experiments.train: the YAML config (with --set
overrides), stage lists, formats and seed streams, pytree flattening for checkpoints."""

import pathlib
import sys

import jax
import yaml

from experiments import training_steps as ts
from experiments.checkpoints import has_checkpoint
from model.checkpoint import read_config
from model.config import get_config

LOG_FORMAT = "dosa-train-log-v1"
CHECKPOINT_FORMAT = "dosa-train-v1"
LONG_CONTEXT_NOTE = (
    "Small RoPE base (rope_theta in the stored config): every rotary frequency completes a "
    "full period within the 2K training window, so contexts of 8K-64K produce no unseen "
    "rotary angles; evaluate with rope_scaling = 1 (linear position interpolation without "
    "fine-tuning measured far worse). A short dense_long stage on longer windows (when run) "
    "teaches attention to ignore the extra distractors of long contexts.")

STAGE_SEED_STREAM = {"dense": 1, "indexer_warmup": 2, "dense_long": 3}
HELDOUT_SEED_STREAM = 1000


# --------------------------------------------------------------------------- config

def load_config(path, overrides=()):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key.path=value, got {item!r}")
        key, value = item.split("=", 1)
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {} if node.get(p) is None else node[p]
            node = node[p]
        node[parts[-1]] = yaml.safe_load(value)
    return cfg


def parse_stage_ints(text, what):
    """'dense=100,indexer_warmup=20' -> {'dense': 100, 'indexer_warmup': 20}."""
    out = {}
    if not text:
        return out
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in ts.STAGES:
            raise ValueError(f"{what}: unknown stage {name!r}; stages are {ts.STAGES}")
        out[name] = int(value)
        if out[name] < 0:
            raise ValueError(f"{what}: {name} must be >= 0")
    return out


def model_config(cfg):
    m = cfg["model"]
    return get_config(m.get("preset", "small"), **(m.get("overrides") or {}))


def init_source(cfg):
    """The YAML's `init_from` (a checkpoint directory whose weights and config a run starts
    from, instead of a random initialisation) -> (path, {"config", "metadata"}), or
    (None, None) when the key is absent. A present but empty key is an error: the YAML
    wants a checkpoint (--set init_from=DIR)."""
    if "init_from" not in cfg:
        return None, None
    if not cfg["init_from"]:
        raise ValueError("init_from must name a checkpoint directory (--set init_from=DIR)")
    if (cfg.get("model") or {}).get("preset"):
        raise ValueError("set either init_from or model.preset, not both: the architecture "
                         "comes from the init_from checkpoint")
    path = pathlib.Path(cfg["init_from"]).resolve()
    if not has_checkpoint(path):
        raise ValueError(f"init_from: no checkpoint in {path}")
    stored, metadata = read_config(path)
    return path, {"config": stored, "metadata": metadata}


def stage_list(cfg):
    """The configured stages in training order: [(name, settings)] (steps 0 = skipped)."""
    stages = cfg.get("stages") or {}
    unknown = sorted(set(stages) - set(ts.STAGES))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; stages are {ts.STAGES}")
    return [(name, stages[name]) for name in ts.STAGES if name in stages]


# ------------------------------------------------------------------------ helpers

def flatten_tree(tree):
    return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def unflatten_tree(like, flat):
    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, [flat[str(i)] for i in range(treedef.num_leaves)])


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
