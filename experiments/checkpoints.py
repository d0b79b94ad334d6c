"""The trained model shipped with the repo: `checkpoints/small/` (made by experiments.train).

    from experiments.checkpoints import load_default_model
    model, metadata = load_default_model(attention="sparse", indexer="hierarchical")
"""

import os
import pathlib

from model.checkpoint import read_config, restore_checkpoint

from experiments.common import REPO_ROOT  # noqa: E402
DEFAULT_CHECKPOINT = REPO_ROOT / "checkpoints" / "small"
ENV_VAR = "DOSA_CHECKPOINT"


class CheckpointMissingError(FileNotFoundError):
    pass


def default_checkpoint_dir():
    """$DOSA_CHECKPOINT if set, else <repo>/checkpoints/small."""
    return pathlib.Path(os.environ.get(ENV_VAR) or DEFAULT_CHECKPOINT)


def _missing(directory):
    return CheckpointMissingError(
        f"no trained checkpoint at {directory}. It is made by `python -m experiments.train "
        f"--config experiments/configs/train_small.yaml --out {directory}` (see "
        f"experiments/README.md), or shipped in the repo as checkpoints/small/; set "
        f"${ENV_VAR} to use another directory.")


def has_checkpoint(directory=None):
    directory = pathlib.Path(directory) if directory is not None else default_checkpoint_dir()
    if not directory.is_dir():
        return False
    return any(p.is_dir() and p.name.isdigit() for p in directory.iterdir())


def load_default_model(directory=None, *, step=None, **config_overrides):
    """-> (Transformer, metadata). config_overrides change run-time switches (attention,
    indexer, top_k, rope_scaling, prefill_chunk, max_seq_len, dtype); architecture fields
    must match the stored ones (ValueError otherwise). Raises CheckpointMissingError (a
    FileNotFoundError) naming the command that makes the checkpoint when there is none."""
    directory = pathlib.Path(directory) if directory is not None else default_checkpoint_dir()
    if not has_checkpoint(directory):
        raise _missing(directory)
    stored, _ = read_config(directory, step)
    config = stored.replace(**config_overrides) if config_overrides else stored
    model, metadata, _ = restore_checkpoint(directory, config, step=step)
    return model, metadata
