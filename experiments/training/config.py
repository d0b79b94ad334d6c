"""The configuration of a training run (experiments.training.train): a YAML file
(experiments/configs/*.yaml) with `--set key.path=value` overrides, read into frozen,
validated dataclasses.

    seed: 0
    init_from: DIR        # absent: random initialisation. DIR: start from that checkpoint's
                          # weights and architecture. Present but empty (null): required,
                          # given on the command line (--set init_from=DIR).
    model:   ModelSection     preset (default "small"; not with init_from), overrides
    data:    DataSection      seq_len, heldout_fraction, max_files
    train:   TrainSection     matmul_precision, micro_batches, log_every, save_every,
                              eval_batches, final_reserve_s
    stages:  StagesSection    dense, dense_long, indexer_warmup: a StageConfig each. Stages
                              run in that order whatever the YAML's order; an absent stage
                              does not run, one with steps: 0 is recorded as skipped.

Unknown keys are rejected at every level, naming the key and the allowed ones; bad values
name the field's path and the allowed range ("stages.dense.batch_size must be an int >= 1,
got 0"). Numbers may be written as strings (YAML 1.1 reads 1e-3, without a dot, as one).
"""

import dataclasses
import pathlib

from experiments.schema import (
    ConfigError,
    ConfigSection,
    ModelSection,
    apply_overrides,
    check_bool,
    check_int,
    check_number,
    fail,
    read_yaml,
)
from experiments.training import steps as ts
from model.checkpoint import has_checkpoint, read_config
from model.presets import get_config

__all__ = ["ConfigError", "ModelSection", "apply_overrides", "load_config"]

@dataclasses.dataclass(frozen=True)
class DataSection(ConfigSection):
    """seq_len: tokens per training window (stages may set their own).
    heldout_fraction: share of the files held out (by path: experiments.data.split_files).
    max_files: only the first N files of the sorted list (smoke runs); None: all."""

    seq_len: int = 2048
    heldout_fraction: float = 0.05
    max_files: int | None = None

    def __post_init__(self):
        check_int(self, "seq_len", 1)
        check_number(self, "heldout_fraction", "in (0, 1)", lambda x: 0.0 < x < 1.0)
        check_int(self, "max_files", 1, optional=True)


@dataclasses.dataclass(frozen=True)
class TrainSection(ConfigSection):
    """matmul_precision: jax_default_matmul_precision for the run (None: JAX's default).
    micro_batches: gradient accumulation slices per step (a stage may set its own).
    log_every: steps per log line. save_every: steps per resume checkpoint (0: only at
    stage ends). eval_batches: held-out batches evaluated after each stage (0: none).
    final_reserve_s: seconds of --time-budget-s kept for the final save and tar."""

    matmul_precision: str | None = None
    micro_batches: int = 1
    log_every: int = 20
    save_every: int = 0
    eval_batches: int = 0
    final_reserve_s: float = 20.0

    def __post_init__(self):
        if self.matmul_precision is not None and (not isinstance(self.matmul_precision, str)
                                                  or not self.matmul_precision):
            fail("matmul_precision", "None or a jax_default_matmul_precision name",
                  self.matmul_precision)
        check_int(self, "micro_batches", 1)
        check_int(self, "log_every", 1)
        check_int(self, "save_every", 0)
        check_int(self, "eval_batches", 0)
        check_number(self, "final_reserve_s", ">= 0", lambda x: x >= 0.0)


@dataclasses.dataclass(frozen=True)
class StageConfig(ConfigSection):
    """One stage (experiments.training.steps).

    steps: schedule length (0: skipped; --steps overrides, --time-budget-s may shorten).
    batch_size: sequences per step. seq_len: tokens per sequence (None: data.seq_len).
    micro_batches: slices per step, dividing batch_size (None: train.micro_batches).
    remat: rematerialise each block in the backward pass (memory for time).
    lr, warmup_steps, final_lr_frac: linear warm-up to lr, cosine to final_lr_frac * lr.
    weight_decay: AdamW's, on matrices. clip: global gradient norm clip (0: none).
    budget_share: this stage's share of --time-budget-s, against the other run stages'."""

    steps: int = 0
    batch_size: int = 8
    seq_len: int | None = None
    micro_batches: int | None = None
    remat: bool = False
    lr: float = 1e-3
    warmup_steps: int = 0
    final_lr_frac: float = 0.1
    weight_decay: float = 0.0
    clip: float = 1.0
    budget_share: float = 1.0

    def __post_init__(self):
        check_int(self, "steps", 0)
        check_int(self, "batch_size", 1)
        check_int(self, "seq_len", 1, optional=True)
        check_int(self, "micro_batches", 1, optional=True)
        check_bool(self, "remat")
        check_number(self, "lr", "> 0", lambda x: x > 0.0)
        check_int(self, "warmup_steps", 0)
        check_number(self, "final_lr_frac", "in [0, 1]", lambda x: 0.0 <= x <= 1.0)
        check_number(self, "weight_decay", ">= 0", lambda x: x >= 0.0)
        check_number(self, "clip", ">= 0", lambda x: x >= 0.0)
        check_number(self, "budget_share", ">= 0", lambda x: x >= 0.0)


@dataclasses.dataclass(frozen=True)
class StagesSection(ConfigSection):
    """The stages to run, in training order (the fields' order, steps.STAGES); None: not
    run."""

    dense: StageConfig | None = None
    dense_long: StageConfig | None = None
    indexer_warmup: StageConfig | None = None

    def __post_init__(self):
        for name in ts.STAGES:
            value = getattr(self, name)
            if value is not None and not isinstance(value, StageConfig):
                fail(name, "a mapping of StageConfig fields", value)


@dataclasses.dataclass(frozen=True)
class TrainingConfig(ConfigSection):
    """A whole training run (see the module docstring). init_from: None = absent (random
    initialisation), "" = required but not given (the trainer refuses to start), else the
    checkpoint directory."""

    seed: int = 0
    init_from: str | None = None
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    stages: StagesSection = dataclasses.field(default_factory=StagesSection)

    @classmethod
    def from_dict(cls, data):
        if isinstance(data, dict) and "init_from" in data and data["init_from"] is None:
            data = {**data, "init_from": ""}  # `init_from:` written empty: required
        return super().from_dict(data)

    def to_dict(self):
        out = super().to_dict()
        if out["init_from"] is None:  # absent, so that from_dict(to_dict()) round-trips
            del out["init_from"]
        return out

    def __post_init__(self):
        check_int(self, "seed", 0)
        if self.init_from is not None and not isinstance(self.init_from, str):
            fail("init_from", "a checkpoint directory", self.init_from)
        for name, kind in (("model", ModelSection), ("data", DataSection),
                           ("train", TrainSection), ("stages", StagesSection)):
            if not isinstance(getattr(self, name), kind):
                fail(name, f"a mapping of {kind.__name__} fields", getattr(self, name))
        if self.init_from is not None and self.model.preset:
            raise ConfigError("", "set either init_from or model.preset, not both: the "
                                  "architecture comes from the init_from checkpoint")
        for name, stage in self.stage_list():
            micro = self.stage_micro_batches(stage)
            if stage.batch_size % micro:
                raise ConfigError(f"stages.{name}.batch_size",
                                  f"must be a multiple of micro_batches ({micro}), got "
                                  f"{stage.batch_size}")

    def stage_list(self):
        """The configured stages in training order: [(name, StageConfig)]."""
        return [(name, getattr(self.stages, name)) for name in ts.STAGES
                if getattr(self.stages, name) is not None]

    def stage_seq_len(self, stage):
        return self.data.seq_len if stage.seq_len is None else stage.seq_len

    def stage_micro_batches(self, stage):
        return self.train.micro_batches if stage.micro_batches is None else stage.micro_batches


# --------------------------------------------------------------------------- loading

def load_config(path, overrides=()):
    """The YAML at `path` with the `--set` overrides applied -> TrainingConfig
    (ConfigError, a ValueError, on an unknown key or a bad value)."""
    return TrainingConfig.from_dict(read_yaml(path, overrides))


def parse_stage_ints(text, what):
    """'dense=100,indexer_warmup=20' -> {'dense': 100, 'indexer_warmup': 20}."""
    out = {}
    if not text:
        return out
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in ts.STAGES:
            raise ValueError(f"{what}: unknown stage {name!r}; stages are {ts.STAGES}")
        out[name] = int(value)
        if out[name] < 0:
            raise ValueError(f"{what}: {name} must be >= 0")
    return out


def model_config(cfg):
    """The ModelConfig of a run without init_from: the preset with the overrides."""
    return get_config(cfg.model.preset or "small", **cfg.model.overrides)


def init_source(cfg):
    """cfg.init_from (a checkpoint directory whose weights and config a run starts from,
    instead of a random initialisation) -> (path, {"config", "metadata"}), or (None, None)
    when absent. Required but not given (""), or no checkpoint there: ValueError."""
    if cfg.init_from is None:
        return None, None
    if not cfg.init_from:
        raise ValueError("init_from must name a checkpoint directory (--set init_from=DIR)")
    path = pathlib.Path(cfg.init_from).resolve()
    if not has_checkpoint(path):
        raise ValueError(f"init_from: no checkpoint in {path}")
    stored, metadata = read_config(path)
    return path, {"config": stored, "metadata": metadata}
