"""Orbax checkpoints that carry the ModelConfig beside the weights."""

import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from model.coarse_screen_file import (
    SCREEN_FILE,
    has_coarse_screen,
    load_coarse_screen,
    reset_coarse_screens,
)
from model.config import ModelConfig
from model.layer_stack import layered_pure_dict, stacked_pure_dict
from model.transformer import Transformer, with_config

# Fields that fix the weights' shapes or meaning. The rest (attention, indexer, top_k,
# prefill_chunk, max_seq_len, rope_scaling, dtype) are run-time switches a user may change
# when loading, e.g. running a densely trained model with sparse attention.
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                       "d_ff", "index_heads", "index_dim", "index_rope_dim", "rope_theta",
                       "norm_eps", "tie_embeddings", "mla", "moe", "yarn",
                       "index_rope_interleaved", "v4")


def _architecture(config, name):
    value = getattr(config, name)
    if name == "mla" and value is not None:  # absorb is a run-time switch (the same weights)
        value = value.replace(absorb=True)
    return value


def _manager(directory, max_to_keep=None):
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(pathlib.Path(directory).resolve(), options=options)


def save_checkpoint(directory, model, *, step=0, metadata=None, extra=None, max_to_keep=None):
    """Saves model weights, its config and JSON metadata (plus an optional `extra` pytree,
    e.g. optimizer state) as step `step` under `directory`."""
    # Host arrays: no device shardings are recorded, so a checkpoint written on a GPU restores
    # on a CPU-only machine and vice versa. Per layer ("layers" / i / ...), whatever the
    # stacking of model.layer_stack: the same files before and after it.
    weights = jax.tree.map(lambda x: np.asarray(jax.device_get(x)),
                           layered_pure_dict(nnx.state(model, nnx.Param), model.config))
    items = dict(
        state=ocp.args.StandardSave(weights),
        config=ocp.args.JsonSave(model.config.to_dict()),
        metadata=ocp.args.JsonSave(metadata or {}),
    )
    if extra is not None:
        items["extra"] = ocp.args.StandardSave(extra)
    with _manager(directory, max_to_keep) as mngr:
        mngr.save(step, args=ocp.args.Composite(**items))
        mngr.wait_until_finished()


def latest_step(directory):
    with _manager(directory) as mngr:
        return mngr.latest_step()


def read_config(directory, step=None):
    with _manager(directory) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {directory}")
        restored = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore(),
                                                             metadata=ocp.args.JsonRestore()))
    return ModelConfig.from_dict(restored["config"]), dict(restored["metadata"] or {})


def check_compatible(stored, requested):
    diffs = [f"{name}: checkpoint has {getattr(stored, name)!r}, requested "
             f"{getattr(requested, name)!r}" for name in ARCHITECTURE_FIELDS
             if _architecture(stored, name) != _architecture(requested, name)]
    if diffs:
        raise ValueError("checkpoint does not match the requested ModelConfig: " + "; ".join(diffs))


def restore_checkpoint(directory, config=None, *, step=None, extra_target=None):
    """-> (Transformer, metadata dict, extra or None).

    config: None uses the stored config; otherwise its architecture fields must equal the
    stored ones (ValueError naming each differing field) and its run-time switches apply.
    extra_target: an abstract pytree to restore the `extra` item into (e.g. optimizer state).
    """
    stored, metadata = read_config(directory, step)
    if config is None:
        config = stored
    check_compatible(stored, config)
    # Restored with the stored layers' parameters; a requested indexer_types that makes
    # layers shared then drops their indexers (with_config).
    requested, config = config, config.replace(indexer_types=stored.indexer_types)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    # Name this host's device: checkpoints that did record a device (e.g. cuda:0) still load.
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          layered_pure_dict(params, config))
    items = dict(state=ocp.args.StandardRestore(target))
    if extra_target is not None:
        items["extra"] = ocp.args.StandardRestore(extra_target)
    with _manager(directory) as mngr:
        step = mngr.latest_step() if step is None else step
        restored = mngr.restore(step, args=ocp.args.Composite(**items))
    nnx.replace_by_pure_dict(params, stacked_pure_dict(restored["state"], config))
    model = reset_coarse_screens(nnx.merge(graphdef, params, rest))
    attach_coarse_screen(model, directory)
    if requested != config:
        model = with_config(model, requested)
    return model, metadata, restored.get("extra") if extra_target is not None else None


def attach_coarse_screen(model, directory):
    """Loads DIR's trained coarse screens into `model` when DIR has them (see
    model.coarse_screen_file) -> whether it did; ValueError when the model's config asks
    for the learned screen (hierarchical.coarse = "learned") and DIR has none."""
    if has_coarse_screen(directory):
        load_coarse_screen(directory, model)
        return True
    if model.config.hierarchical.coarse == "learned":
        raise ValueError(f"hierarchical.coarse='learned' needs trained coarse screens, and "
                         f"{directory} has no {SCREEN_FILE}: train them with `python -m "
                         f"experiments.training.coarse_screen` or use coarse='mean'")
    return False


# ---------------------------------------------------------------- the shipped checkpoint

# The trained `small` model that ships with the repository (made by experiments.training).
DEFAULT_CHECKPOINT = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / "small"
CHECKPOINT_ENV_VAR = "DOSA_CHECKPOINT"


class CheckpointMissingError(FileNotFoundError):
    pass


def default_checkpoint_dir():
    """$DOSA_CHECKPOINT if set, else <repo>/checkpoints/small."""
    return pathlib.Path(os.environ.get(CHECKPOINT_ENV_VAR) or DEFAULT_CHECKPOINT)


def has_checkpoint(directory=None):
    """Whether `directory` (default: default_checkpoint_dir()) holds a saved step."""
    directory = pathlib.Path(directory) if directory is not None else default_checkpoint_dir()
    if not directory.is_dir():
        return False
    return any(p.is_dir() and p.name.isdigit() for p in directory.iterdir())


def load_default_model(directory=None, *, step=None, **config_overrides):
    """-> (Transformer, metadata) from `directory` (default: default_checkpoint_dir()).

    config_overrides change run-time switches (attention, indexer, top_k, rope_scaling,
    prefill_chunk, max_seq_len, dtype); architecture fields must match the stored ones
    (ValueError otherwise). Raises CheckpointMissingError (a FileNotFoundError) naming the
    command that makes the checkpoint when there is none.
    """
    directory = pathlib.Path(directory) if directory is not None else default_checkpoint_dir()
    if not has_checkpoint(directory):
        raise CheckpointMissingError(
            f"no trained checkpoint at {directory}. It is made by `python -m "
            f"experiments.training.train --config experiments/configs/train_small.yaml --out "
            f"{directory}` (docs/training.md), or shipped in the repository as "
            f"checkpoints/small/; set ${CHECKPOINT_ENV_VAR} to use another directory.")
    stored, _ = read_config(directory, step)
    config = stored.replace(**config_overrides) if config_overrides else stored
    model, metadata, _ = restore_checkpoint(directory, config, step=step)
    return model, metadata
