"""experiments.training.config: the typed training config read from YAML with --set
overrides."""

import dataclasses
import pathlib

import pytest
import yaml

from experiments.training import steps as ts
from experiments.training.config import (
    ConfigError,
    StagesSection,
    TrainingConfig,
    apply_overrides,
    load_config,
)

# Training configs: every YAML in experiments/configs/ but the main job's (run_*.yaml).
CONFIGS = sorted(p for p in (pathlib.Path(__file__).resolve().parents[2] / "experiments"
                             / "configs").glob("*.yaml") if not p.name.startswith("run_"))
TINY = next(p for p in CONFIGS if p.name == "train_tiny.yaml")


def _entries(raw, prefix=()):
    """(path, value) of every leaf of a YAML dict, model.overrides kept whole."""
    for key, value in raw.items():
        path = prefix + (key,)
        if isinstance(value, dict) and path != ("model", "overrides"):
            yield from _entries(value, path)
        else:
            yield path, value


def _get(cfg, path):
    for key in path:
        cfg = cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)
    return cfg


def test_there_are_configs_to_check():
    assert {p.name for p in CONFIGS} >= {"train_small.yaml", "train_tiny.yaml",
                                         "indexer_rewarm.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_yaml_loads_with_its_values_and_round_trips(path):
    raw = yaml.safe_load(path.read_text())
    cfg = load_config(path)
    for key, value in _entries(raw):
        if key == ("init_from",) and value is None:
            assert cfg.init_from == ""  # written empty: required on the command line
        else:
            assert _get(cfg, key) == value, key
    assert [name for name, _ in cfg.stage_list()] == [s for s in ts.STAGES if s in raw["stages"]]
    assert TrainingConfig.from_dict(cfg.to_dict()) == cfg


def test_stage_defaults_come_from_the_data_and_train_sections():
    cfg = load_config(TINY, ["train.micro_batches=2", "stages.dense.batch_size=4"])
    dense, dense_long = cfg.stages.dense, cfg.stages.dense_long
    assert dense.seq_len is None and cfg.stage_seq_len(dense) == cfg.data.seq_len == 64
    assert cfg.stage_micro_batches(dense) == 2
    assert cfg.stage_seq_len(dense_long) == 128 and cfg.stage_micro_batches(dense_long) == 2


def test_stages_run_in_training_order_whatever_the_yaml_order():
    assert tuple(f.name for f in dataclasses.fields(StagesSection)) == ts.STAGES
    cfg = TrainingConfig.from_dict({"stages": {"indexer_warmup": {"steps": 1},
                                               "dense": {"steps": 2}}})
    assert [name for name, _ in cfg.stage_list()] == ["dense", "indexer_warmup"]


@pytest.mark.parametrize("override, names", [
    ("sed=1", ["'sed'", "TrainingConfig", "'seed'", "'stages'"]),
    ("train.log_evry=5", ["train:", "'log_evry'", "'log_every'", "'save_every'"]),
    ("stages.dense.batchsize=4", ["stages.dense:", "'batchsize'", "'batch_size'", "'lr'"]),
    ("stages.sparse.steps=4", ["stages:", "'sparse'", "'dense_long'", "'indexer_warmup'"]),
    ("model.overrides.n_layer=4", ["model.overrides:", "'n_layer'", "'n_layers'"]),
])
def test_unknown_keys_are_rejected_by_name_with_the_allowed_ones(override, names):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert all(name in str(info.value) for name in names), str(info.value)


@pytest.mark.parametrize("override, message", [
    ("stages.dense.batch_size=0", "stages.dense.batch_size must be an int >= 1, got 0"),
    ("stages.dense.steps=-1", "stages.dense.steps must be an int >= 0, got -1"),
    ("stages.indexer_warmup.lr=0", "stages.indexer_warmup.lr must be a number > 0, got 0"),
    ("stages.dense.remat=maybe", "stages.dense.remat must be true or false, got 'maybe'"),
    ("stages.dense.final_lr_frac=2", "stages.dense.final_lr_frac must be a number in [0, 1]"),
    ("stages.dense.batch_size=3", "stages.dense.batch_size must be a multiple of "
                                  "micro_batches (2), got 3"),
    ("data.heldout_fraction=1.5", "data.heldout_fraction must be a number in (0, 1), got 1.5"),
    ("data.seq_len=2.5", "data.seq_len must be an int >= 1, got 2.5"),
    ("train.log_every=0", "train.log_every must be an int >= 1, got 0"),
    ("model.preset=huge", "model.preset must be None or one of"),
    ("stages=4", "stages must be a mapping of StagesSection fields, got 4"),
])
def test_bad_values_are_rejected_with_the_field_and_the_allowed_range(override, message):
    overrides = [override] + (["train.micro_batches=2", "stages.dense_long.batch_size=2"]
                              if "multiple" in message else [])
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert message in str(info.value), str(info.value)


def test_overrides_parse_as_yaml_and_numbers_may_be_strings():
    cfg = load_config(TINY, ["stages.dense.lr=1e-3", "stages.dense.remat=true",
                             "data.max_files=null", "model.overrides.top_k=8",
                             "stages.dense.micro_batches=2"])
    assert cfg.stages.dense.lr == 1e-3 and isinstance(cfg.stages.dense.lr, float)
    assert cfg.stages.dense.remat is True and cfg.data.max_files is None
    assert cfg.model.overrides == {"rope_theta": 300.0, "top_k": 8}
    assert cfg.stage_micro_batches(cfg.stages.dense) == 2
    with pytest.raises(ValueError, match="key.path=value"):
        apply_overrides({}, ["stages.dense.lr"])
    with pytest.raises(ValueError, match="seed is 0, not a section"):
        apply_overrides({"seed": 0}, ["seed.x=1"])


def test_init_from_absent_required_or_given():
    assert TrainingConfig.from_dict({}).init_from is None
    required = TrainingConfig.from_dict({"init_from": None})
    assert required.init_from == ""
    given = TrainingConfig.from_dict({"init_from": "/ckpt"})
    for cfg in (TrainingConfig(), required, given):
        assert TrainingConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="either init_from or model.preset"):
        TrainingConfig.from_dict({"init_from": "/ckpt", "model": {"preset": "tiny"}})


def test_empty_sections_take_their_defaults():
    cfg = TrainingConfig.from_dict({"train": None, "data": None, "stages": {"dense": None}})
    assert cfg.train == TrainingConfig().train and cfg.data == TrainingConfig().data
    assert cfg.stage_list() == []
