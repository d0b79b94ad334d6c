"""The trained coarse screens of a model's layers, stored beside its checkpoint:

    DIR/coarse_screen.safetensors   every layer's screen (scales, temperatures), named by
                                    its path in the Transformer; the safetensors metadata
                                    holds the fingerprint of the indexer it was distilled
                                    from and the training record (JSON)

One file for every kind of checkpoint (the shipped orbax one, a pretrained model's indexer
folder): the screen is trained after the model, with the model frozen, and is only valid
for the indexer it was distilled from, so loading checks that fingerprint.
"""

import hashlib
import json
import pathlib

import numpy as np
from flax import nnx

from indexer import CoarseScreen, ScreenParam
from model.layer_stack import assign_named, layer_plan, named_values, stack_trees

SCREEN_FILE = "coarse_screen.safetensors"
INDEXER_PARAMS = nnx.All(nnx.Param, nnx.PathContains("indexer"))


class CoarseScreenFileError(ValueError):
    pass


def indexer_fingerprint(model):
    """sha256 of the model's indexer parameters (per-layer names, shapes, float32 bytes)."""
    digest = hashlib.sha256()
    for name, value in sorted(named_values(model, INDEXER_PARAMS).items()):
        value = np.ascontiguousarray(np.asarray(value, np.float32))
        digest.update(f"{name}:{value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def reset_coarse_screens(model):
    """Every layer's screen back to the untrained one (the mean screen): used where a model
    is assembled from abstract shapes (a checkpoint restore), which leave them unset."""
    for layers, stack in zip(layer_plan(model.config).stacks, model.stacks):
        if stack.indexer is not None:  # shared layers (indexer_types) have neither
            graphdef, state = nnx.split(CoarseScreen(model.config.index_heads,
                                                     model.config.index_dim))
            stack.coarse_screen = nnx.merge(graphdef, stack_trees([state] * len(layers)))
    return model


def has_coarse_screen(directory):
    return directory is not None and (pathlib.Path(directory) / SCREEN_FILE).is_file()


def save_coarse_screen(directory, model, *, record=None):
    """Writes the screens of `model` to DIR/coarse_screen.safetensors with the fingerprint of
    its indexer and `record` (a JSON-able dict: how they were trained, what they reached)."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(value, np.float32)
              for name, value in named_values(model, ScreenParam).items()}
    meta = {"indexer_sha256": indexer_fingerprint(model), "record": json.dumps(record or {})}
    path = directory / SCREEN_FILE
    save_file(arrays, str(path), metadata=meta)
    path.chmod(0o644)  # safetensors writes 0600; the file ships with the model
    return path


def read_screen_record(directory):
    """The training record saved with the screens (dict)."""
    from safetensors import safe_open

    path = pathlib.Path(directory) / SCREEN_FILE
    with safe_open(str(path), "np") as f:
        return json.loads((f.metadata() or {}).get("record", "{}"))


def load_coarse_screen(directory, model):
    """Writes DIR's trained screens into `model` (in place) -> the training record.

    CoarseScreenFileError (naming the file) when the file is unreadable, a layer's screen
    is missing or misshapen, or it was distilled from another indexer than the model's.
    """
    from safetensors import safe_open

    path = pathlib.Path(directory) / SCREEN_FILE
    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:
        raise CoarseScreenFileError(f"{path}: not a readable safetensors file ({e})") from e
    expected = indexer_fingerprint(model)
    if meta.get("indexer_sha256") != expected:
        raise CoarseScreenFileError(
            f"{path}: these coarse screens were distilled from another indexer (sha256 "
            f"{meta.get('indexer_sha256')!r}, the model's is {expected!r}); retrain them with "
            f"`python -m experiments.training.coarse_screen`")
    for name, value in named_values(model, ScreenParam).items():
        if name not in arrays:
            raise CoarseScreenFileError(f"{path}: coarse screen parameter {name} is missing")
        if arrays[name].shape != value.shape:
            raise CoarseScreenFileError(f"{path}: coarse screen parameter {name} has shape "
                                        f"{arrays[name].shape}, the model needs {value.shape}")
    assign_named(model, ScreenParam, arrays)
    return json.loads(meta.get("record", "{}"))
