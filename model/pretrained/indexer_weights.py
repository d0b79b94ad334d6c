"""The DSA retrofit of a pretrained model ships as its indexer weights only (small), with
the ModelConfig they were trained under and the sha256 of the base file they belong to:

    DIR/indexer.safetensors   every indexer parameter, named by its path in the Transformer
    DIR/dsa.json              {"config": ModelConfig dict, "base": {...}, "metadata": {...}}
"""

import json
import pathlib

import numpy as np
from flax import nnx

from model.config import ModelConfig
from model.layer_stack import assign_named, named_values
from model.pretrained.llama import PretrainedFormatError

WEIGHTS_FILE, META_FILE = "indexer.safetensors", "dsa.json"
INDEXER_PARAMS = nnx.All(nnx.Param, nnx.PathContains("indexer"))


def has_indexer_weights(directory):
    directory = pathlib.Path(directory)
    return (directory / WEIGHTS_FILE).is_file() and (directory / META_FILE).is_file()


def save_indexer_weights(directory, model, *, base, metadata=None, config=None):
    """Writes the indexer parameters of `model`, its config, `base` (a dict naming the base
    checkpoint: name, file, sha256) and JSON `metadata` under `directory`."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(value, np.float32)
              for name, value in named_values(model, INDEXER_PARAMS).items()}
    save_file(arrays, str(directory / WEIGHTS_FILE))
    meta = dict(config=(config or model.config).to_dict(), base=base, metadata=metadata or {})
    (directory / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def read_indexer_meta(directory):
    path = pathlib.Path(directory) / META_FILE
    try:
        meta = json.loads(path.read_text())
        return ModelConfig.from_dict(meta["config"]), meta["base"], meta.get("metadata", {})
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise PretrainedFormatError(f"{path}: not a readable indexer description ({e})") from e


def load_indexer_weights(directory, model):
    """Writes the saved indexer parameters into `model` (in place); each must exist with the
    model's shape (PretrainedFormatError naming the file and the parameter)."""
    from safetensors.numpy import load_file

    path = pathlib.Path(directory) / WEIGHTS_FILE
    try:
        arrays = load_file(str(path))
    except Exception as e:
        raise PretrainedFormatError(f"{path}: not a readable safetensors file ({e})") from e
    for name, value in named_values(model, INDEXER_PARAMS).items():
        if name not in arrays:
            raise PretrainedFormatError(f"{path}: indexer parameter {name} is missing")
        if arrays[name].shape != value.shape:
            raise PretrainedFormatError(f"{path}: indexer parameter {name} has shape "
                                        f"{arrays[name].shape}, the model needs {value.shape}")
    assign_named(model, INDEXER_PARAMS, arrays)
    return model
