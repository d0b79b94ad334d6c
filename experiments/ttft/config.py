"""The YAML config of `python -m experiments.run` (experiments/configs/run_*.yaml).

    model:        ModelSource   checkpoint (default: the shipped one) | preset with
                                random_weights: true; overrides (ModelConfig fields)
    lengths:      context lengths in tokens, measured in this order
    modes:        the measured configurations, a ModeSpec each (name, attention, indexer,
                                hierarchical overrides, ModelConfig overrides, max_length,
                                time_max_length)
    reference:    the mode the others are compared with (default sparse-flat)
    compare:      the mode the summary reports against the reference (sparse-hierarchical)
    repetitions:  timed rounds per length, after a compile-only warm-up: each round times
                  every mode and split baseline once (interleaved)
    split:        time the window baselines that split each TTFT into indexer / attention /
                  other (default true; false: TTFT and fidelity only, no indexer share)
    fidelity_positions: last positions whose logits are compared (teacher-forced)
    decode_steps: timed decode steps after the prefill (inter-token latency)

Unknown keys and bad values raise ConfigError (a ValueError) naming the entry's path.
"""

import dataclasses

from experiments.schema import ConfigError, ConfigSection, check_bool, check_int, fail, read_yaml
from indexer.config import HierarchicalConfig
from indexer.selection import selection_names
from model.config import ATTENTION_KINDS, ModelConfig
from model.presets import PRESETS

MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def _check_overrides(name, value, allowed, what):
    if not isinstance(value, dict):
        fail(name, f"a mapping of {what} fields", value)
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ConfigError(f"{name}:", f"unknown {what} fields {unknown}; allowed: "
                                      f"{sorted(allowed)}")


@dataclasses.dataclass(frozen=True)
class ModelSource(ConfigSection):
    """checkpoint: a checkpoint directory (None: the shipped checkpoints/small). pretrained:
    a pretrained model by name (model.pretrained.PRETRAINED, e.g. smollm2-135m, with its
    shipped indexer) or a .gguf / Hugging Face folder path; its held-out text is Python's
    documentation (experiments.text_corpus). preset: a model.config preset with random
    weights (needs random_weights: true: timing only, no fidelity figures). layers: with a
    preset, the indices of its layers to keep (model.config.keep_layers: each keeps its
    dense / MoE and full / shared kind; e.g. [2, 3, 4, 5] of deepseek-v3.2: one dense and
    three MoE layers at full width); None: all. overrides: ModelConfig fields (run-time
    switches for a checkpoint; any field for a preset, set after `layers`)."""

    checkpoint: str | None = None
    pretrained: str | None = None
    preset: str | None = None
    random_weights: bool = False
    layers: tuple | None = None
    overrides: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        check_bool(self, "random_weights")
        if self.layers is not None:
            if self.preset is None:
                fail("layers", "None unless model.preset is set", self.layers)
            if not isinstance(self.layers, (list, tuple)) or not self.layers or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0
                    for i in self.layers):
                fail("layers", "a non-empty list of layer indices", self.layers)
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.preset is not None and self.preset not in PRESETS:
            fail("preset", f"None or one of {sorted(PRESETS)}", self.preset)
        if self.random_weights != (self.preset is not None):
            raise ConfigError("", "set model.preset together with model.random_weights: true "
                                  "(random weights, timing only), or neither (a checkpoint)")
        if sum(x is not None for x in (self.preset, self.checkpoint, self.pretrained)) > 1:
            raise ConfigError("", "set at most one of model.checkpoint, model.pretrained and "
                                  "model.preset")
        _check_overrides("overrides", self.overrides, MODEL_FIELDS, "ModelConfig")


@dataclasses.dataclass(frozen=True)
class ModeSpec(ConfigSection):
    """name: the label in results ("sparse-flat", "sparse-hierarchical", "dense", or an
    ablation's own). attention: dense | sparse. indexer: a selection kind
    (indexer.selection: flat | hierarchical | window).
    hierarchical: HierarchicalConfig fields over the model's. overrides: other ModelConfig
    run-time fields (top_k, flat_index_layers, ...). max_length: lengths above it are not
    measured for this mode (None: all). time_max_length: lengths above it run this mode
    once, untimed, for the fidelity figures only (dense at 8K on 2 cores: what sparse is
    compared with, without timing it); None: every length is timed."""

    name: str = ""
    attention: str = "sparse"
    indexer: str = "flat"
    hierarchical: dict = dataclasses.field(default_factory=dict)
    overrides: dict = dataclasses.field(default_factory=dict)
    max_length: int | None = None
    time_max_length: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            fail("name", "a non-empty string", self.name)
        if self.attention not in ATTENTION_KINDS:
            fail("attention", f"one of {ATTENTION_KINDS}", self.attention)
        if self.indexer not in selection_names():
            fail("indexer", f"one of {selection_names()}", self.indexer)
        _check_overrides("hierarchical", self.hierarchical,
                         {f.name for f in dataclasses.fields(HierarchicalConfig)},
                         "HierarchicalConfig")
        _check_overrides("overrides", self.overrides,
                         MODEL_FIELDS - {"attention", "indexer", "hierarchical"}, "ModelConfig")
        check_int(self, "max_length", 1, optional=True)
        check_int(self, "time_max_length", 1, optional=True)

    def timed(self, length):
        """Whether this mode is timed at `length` (else run once for its fidelity)."""
        return self.time_max_length is None or length <= self.time_max_length

    def model_config(self, base):
        """This mode's ModelConfig on top of `base` (ValueError naming a bad field)."""
        hier = base.hierarchical.replace(**self.hierarchical)
        return base.replace(attention=self.attention, indexer=self.indexer, hierarchical=hier,
                            **self.overrides)

    @property
    def sparse(self):
        return self.attention == "sparse"


DEFAULT_MODES = (ModeSpec(name="sparse-flat", attention="sparse", indexer="flat"),
                 ModeSpec(name="sparse-hierarchical", attention="sparse", indexer="hierarchical"),
                 ModeSpec(name="dense", attention="dense", max_length=8192))


@dataclasses.dataclass(frozen=True)
class RunConfig(ConfigSection):
    model: ModelSource = ModelSource()
    lengths: tuple = (8192, 16384, 32768)
    modes: tuple = DEFAULT_MODES
    reference: str = "sparse-flat"
    compare: str = "sparse-hierarchical"
    repetitions: int = 3
    split: bool = True
    fidelity_positions: int = 512
    decode_steps: int = 8

    @classmethod
    def from_dict(cls, data):
        if isinstance(data, dict) and isinstance(data.get("modes"), list):
            modes = []
            for i, mode in enumerate(data["modes"]):
                try:
                    modes.append(ModeSpec.from_dict(mode))
                except ConfigError as e:
                    raise e.within(f"modes[{i}]") from None
            data = {**data, "modes": tuple(modes)}
        if isinstance(data, dict) and isinstance(data.get("lengths"), list):
            data = {**data, "lengths": tuple(data["lengths"])}
        return super().from_dict(data)

    def __post_init__(self):
        lengths = self.lengths
        if not isinstance(lengths, tuple) or not lengths or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 2 for x in lengths):
            fail("lengths", "a non-empty list of ints >= 2", lengths)
        if not isinstance(self.modes, tuple) or not self.modes or not all(
                isinstance(m, ModeSpec) for m in self.modes):
            fail("modes", "a non-empty list of mode mappings", self.modes)
        names = [m.name for m in self.modes]
        if len(set(names)) != len(names):
            fail("modes", "modes with distinct names", names)
        for field in ("reference", "compare"):
            if getattr(self, field) not in names:
                fail(field, f"one of the mode names {names}", getattr(self, field))
        if not self.mode(self.reference).sparse:
            fail("reference", "a sparse mode (recall is measured against its selection)",
                 self.reference)
        check_int(self, "repetitions", 1)
        check_bool(self, "split")
        check_int(self, "fidelity_positions", 1)
        check_int(self, "decode_steps", 0)
        if self.fidelity_positions > min(lengths):
            fail("fidelity_positions", f"an int in [1, min(lengths) = {min(lengths)}]",
                 self.fidelity_positions)

    def mode(self, name):
        return next(m for m in self.modes if m.name == name)


def load_run_config(path, overrides=()):
    """The YAML at `path` (with `--set key.path=value` overrides) -> RunConfig."""
    return RunConfig.from_dict(read_yaml(path, overrides))
