"""DSA transformer in Flax NNX: config, layers, attention, the forward pass, prefill/decode,
tokenizer, checkpoints."""

from model.checkpoint import (
    CheckpointMissingError,
    default_checkpoint_dir,
    has_checkpoint,
    load_default_model,
    restore_checkpoint,
    save_checkpoint,
)
from model.config import PRESETS, ModelConfig, get_config
from model.runner import ModelRunner, length_bucket
from model.sampling import sample_token
from model.transformer import (
    CAPTURE_KINDS,
    DecoderBlock,
    IndexerInputs,
    LayerCache,
    Transformer,
    init_cache,
    with_config,
)

__all__ = ["CAPTURE_KINDS", "CheckpointMissingError", "DecoderBlock", "IndexerInputs",
           "LayerCache", "ModelConfig", "ModelRunner", "PRESETS", "Transformer",
           "default_checkpoint_dir", "get_config", "has_checkpoint", "init_cache",
           "length_bucket", "load_default_model", "restore_checkpoint", "sample_token",
           "save_checkpoint", "with_config"]
