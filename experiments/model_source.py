"""A trained model together with its text: what the coarse-screen training and the
frontier benchmark read (one place that knows where each model's data comes from).

- the shipped byte model (checkpoints/small or --checkpoint DIR): training and held-out
  splits of the Python stdlib sources it was trained on (experiments.data);
- a pretrained model (--model smollm2-135m | PATH, with its warmed indexer): training
  documents of experiments.text_corpus, held out: the pydoc topics text. Contexts past its
  trained length run with RoPE position interpolation (rope_scaling = length / 8192, as
  the indexer benchmark does).
"""

import dataclasses
import pathlib

import numpy as np

PRETRAINED_CONTEXT = 8192


@dataclasses.dataclass
class ModelSource:
    name: str
    model: object  # model.Transformer
    directory: pathlib.Path  # where its trained parts (indexer, coarse screen) live
    train_tokens: np.ndarray
    heldout_tokens: np.ndarray
    indexer_sha256: str | None = None  # a pretrained model's indexer weights (what was measured)


def load_source(*, model_name=None, checkpoint=None, max_length, **overrides):
    """-> ModelSource of the shipped model (checkpoint: its folder, None: shipped) or of the
    pretrained model `model_name`, ready for contexts up to max_length tokens. overrides:
    run-time ModelConfig switches (e.g. attention, indexer)."""
    if model_name:
        from experiments.text_corpus import (
            heldout_text_tokens,
            list_documents,
            split_documents,
            token_stream,
        )
        from model.pretrained import cache_dir, load_pretrained

        scaling = max(1.0, max_length / PRETRAINED_CONTEXT)
        pre = load_pretrained(model_name, max_seq_len=max(max_length, PRETRAINED_CONTEXT),
                              rope_scaling=scaling, **overrides)
        if pre.info["indexer"] == "fresh":
            raise ValueError(f"{model_name} has no trained indexer (run "
                             f"experiments.training.warmup first)")
        train_names, _ = split_documents(list_documents())
        train = token_stream(pre.tokenizer, train_names, cache=cache_dir() / "corpus")
        return ModelSource(model_name, pre.model, pathlib.Path(pre.info["indexer"]), train,
                           heldout_text_tokens(pre.tokenizer), pre.info.get("indexer_sha256"))
    from experiments.data import Corpus
    from model.checkpoint import default_checkpoint_dir, load_default_model

    directory = pathlib.Path(checkpoint) if checkpoint else default_checkpoint_dir()
    model, metadata = load_default_model(directory, **overrides)
    corpus = Corpus(heldout_fraction=metadata.get("data", {}).get("heldout_fraction", 0.05))
    name = "small" if not checkpoint else str(checkpoint)
    return ModelSource(name, model, directory, corpus.train_tokens, corpus.heldout_tokens)


def training_windows(tokens, length, count, *, seed):
    """`count` seeded windows of `length` tokens from a training stream -> int32[count, L]."""
    n = int(tokens.shape[0])
    if n < length:
        raise ValueError(f"training stream of {n} tokens is shorter than {length}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n - length + 1, size=count)
    return np.stack([np.asarray(tokens[s:s + length], np.int32) for s in starts])
