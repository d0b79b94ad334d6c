"""DSA transformer in Flax NNX: config, layers, attention, prefill/decode, tokenizer, checkpoints."""

from model.checkpoint import restore_checkpoint, save_checkpoint
from model.config import PRESETS, ModelConfig, get_config
from model.runner import ModelRunner, length_bucket
from model.sampling import sample_token
from model.transformer import DecoderBlock, LayerCache, Transformer, init_cache

__all__ = ["DecoderBlock", "LayerCache", "ModelConfig", "ModelRunner", "PRESETS", "Transformer",
           "get_config", "init_cache", "length_bucket", "restore_checkpoint", "sample_token",
           "save_checkpoint"]
