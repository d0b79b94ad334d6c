"""Which model a server runs: the shipped checkpoint, the random `tiny` preset, a pretrained
model by name, or a path."""

import dataclasses
import logging
import pathlib

log = logging.getLogger("serving.loading")


@dataclasses.dataclass
class LoadedModel:
    model: object  # model.Transformer with the serving config's switches applied
    tokenizer: object  # encode / decode / bos_id / eos_id / chat_template / vocab_size
    model_id: str
    description: str


def load_model(name, overrides=None):
    """-> LoadedModel. name: "default" (checkpoints/small, or $DOSA_CHECKPOINT), "tiny"
    (random UNTRAINED weights, for tests and development), a name in
    model.pretrained.PRETRAINED, or a path (a dosa checkpoint folder, a .gguf file, a Hugging
    Face folder). overrides: ModelConfig run-time switches; a "hierarchical" dict changes
    only the knobs it names."""
    import flax.nnx as nnx

    import model as dosa_model
    from model.pretrained import ByteTokenizer, load_pretrained

    if name in ("default", "small"):
        net, metadata = dosa_model.load_default_model()
        step = metadata.get("step")
        loaded = LoadedModel(net, ByteTokenizer(), "dosa-small",
                             f"shipped byte-level checkpoint {dosa_model.default_checkpoint_dir()}"
                             + (f" (step {step})" if step is not None else ""))
    elif name == "tiny":
        net = dosa_model.Transformer(dosa_model.get_config("tiny"), rngs=nnx.Rngs(0))
        loaded = LoadedModel(net, ByteTokenizer(), "dosa-tiny-untrained",
                             "tiny preset with RANDOM, UNTRAINED weights (tests, development): "
                             "its output is noise")
    elif pathlib.Path(name).is_dir() and dosa_model.has_checkpoint(name):
        net, _, _ = dosa_model.restore_checkpoint(name)
        loaded = LoadedModel(net, ByteTokenizer(), pathlib.Path(name).name,
                             f"dosa checkpoint {name}")
    else:
        pretrained = load_pretrained(name)
        model_id = pretrained.info.get("name") or pathlib.Path(name).stem
        loaded = LoadedModel(pretrained.model, pretrained.tokenizer, model_id,
                             f"pretrained {pretrained.info.get('path')} "
                             f"(indexer: {pretrained.info.get('indexer')})")
    if overrides:
        loaded.model = dosa_model.with_config(loaded.model,
                                              apply_overrides(loaded.model.config, overrides))
    return loaded


def apply_overrides(config, overrides):
    """config.replace(**overrides), merging a partial "hierarchical" dict into the model's."""
    overrides = dict(overrides)
    if isinstance(overrides.get("hierarchical"), dict):
        overrides["hierarchical"] = config.hierarchical.replace(**overrides["hierarchical"])
    return config.replace(**overrides)
