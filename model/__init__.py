"""DSA transformer in Flax NNX: config, layers, attention, the forward pass, its cache,
prefill/decode, tokenizer, checkpoints.

Names load on first use (PEP 562): `import model.config`, `model.buckets` or
`model.parallel_flags` imports no JAX, so `python -m serving` can read its configuration
and flags before JAX starts.
"""

import importlib

_EXPORTS = {
    "model.buckets": ("length_bucket",),
    "model.cache": ("LayerCache", "init_cache"),
    "model.checkpoint": ("CheckpointMissingError", "default_checkpoint_dir", "has_checkpoint",
                         "load_default_model", "restore_checkpoint", "save_checkpoint"),
    "model.config": ("ModelConfig",),
    "model.presets": ("PRESETS", "get_config"),
    "model.runner": ("ModelRunner",),
    "model.sampling": ("sample_token",),
    "model.transformer": ("CAPTURE_KINDS", "DecoderBlock", "IndexerInputs", "IndexerSource",
                          "Transformer", "with_config"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
