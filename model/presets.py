"""Named ModelConfigs: `tiny` (unit tests), `small` (CPU experiments, the shipped
checkpoint's architecture) and the full-size DSA architectures (model.dsa_presets), and
`get_config`. It sits above model.config: the full-size presets are built by the checkpoint
loader's own mapping, which reads model.config, so the config never imports them."""

from collections.abc import Mapping

from indexer.config import HierarchicalConfig
from model.config import ModelConfig


class _Presets(Mapping):
    """Named ModelConfigs; an entry may be a function that builds it on first use (the
    full-size DSA presets are built by the checkpoint loader's mapping, which imports
    JAX: model.dsa_presets)."""

    def __init__(self, entries):
        self._entries = dict(entries)

    def __getitem__(self, name):
        value = self._entries[name]
        if callable(value):
            value = self._entries[name] = value()
        return value

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)


def _dsa(name):
    def build():
        from model.dsa_presets import dsa_preset
        return dsa_preset(name)
    return build


PRESETS = _Presets({
    # Unit tests: a few ms per step.
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                        max_seq_len=4096, index_heads=2, index_dim=16, index_rope_dim=8, top_k=16,
                        prefill_chunk=64,
                        hierarchical=HierarchicalConfig(block_size=8, candidate_tokens=32,
                                                        query_tile=4, fine_batch_size=32,
                                                        tile_candidate_tokens=128,
                                                        bound_blocks=1)),
    # CPU experiments.
    "small": ModelConfig(),
    # The real architectures, full size (MLA, DeepSeekMoE, their indexers; model/dsa_presets.py
    # says where each value comes from), bf16: shape checks, cost estimates, random-weight
    # timing (keep_layers cuts them down). Never instantiated with weights in tests.
    "deepseek-v3.2": _dsa("deepseek-v3.2"),
    "glm-5": _dsa("glm-5"),
    "deepseek-v4-flash": _dsa("deepseek-v4-flash"),
    "deepseek-v4-pro": _dsa("deepseek-v4-pro"),
})


def get_config(name, **overrides):
    """A preset by name, with field overrides (validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
