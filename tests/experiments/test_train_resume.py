"""experiments.training.train: a tiny run, paused and resumed, equals an uninterrupted one; the
CLI's outputs; a run started from a checkpoint."""

import json
import pathlib
import tarfile

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.training.config import TrainingConfig, load_config
from experiments.training.train import Trainer, main
from model import restore_checkpoint
from model.checkpoint import read_config

TINY = (pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs"
        / "train_tiny.yaml")
QUIET = lambda msg: None  # noqa: E731


def _cfg():
    return load_config(TINY, ["data.max_files=24", "train.eval_batches=0",
                              "stages.dense.steps=3", "stages.dense_long.steps=1",
                              "stages.indexer_warmup.steps=2"])


def _params(directory):
    model, meta, _ = restore_checkpoint(directory)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))], meta


@pytest.mark.slow
def test_resume_continues_the_step_count_and_replays_the_same_run(tmp_path):
    full = Trainer(_cfg(), tmp_path / "full", log=QUIET).run()
    assert full["total_steps"] == 6
    assert full["stages"]["dense_long"]["seq_len"] == 128

    # Pause after 2 steps (inside stage 1), then after 3 more (inside the last stage).
    for run_steps in (2, 3):
        assert Trainer(_cfg(), tmp_path / "parts", run_steps=run_steps, log=QUIET).run() is None
        _, meta = read_config(tmp_path / "parts.work")
        assert not (tmp_path / "parts").exists()
    assert meta["resume"]["global_step"] == 5
    assert meta["resume"]["stages"]["dense_long"]["complete"]
    assert meta["resume"]["stages"]["indexer_warmup"]["steps_done"] == 1
    log = Trainer(_cfg(), tmp_path / "parts", log=QUIET).run()
    assert log["total_steps"] == 6 and log["stages"]["indexer_warmup"]["steps_done"] == 2

    a, meta_full = _params(tmp_path / "full")
    b, meta_parts = _params(tmp_path / "parts")
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert meta_parts["training"]["total_steps"] == 6


@pytest.mark.slow
def test_cli_writes_a_compact_checkpoint_log_and_tar(tmp_path, capsys):
    out = tmp_path / "ckpt" / "tiny"
    main(["--config", str(TINY), "--out", str(out), "--tar", str(tmp_path / "tiny.tar"),
          "--set", "data.max_files=24", "--steps", "dense=2,dense_long=0,indexer_warmup=1"])
    text = capsys.readouterr().out
    assert "SUMMARY dense: steps 2" in text and "indexer_warmup: steps 1" in text
    steps = [p for p in out.iterdir() if p.is_dir()]
    assert [p.name for p in steps] == ["3"]
    assert not (steps[0] / "extra").exists()  # no optimizer state in the shipped checkpoint
    log = json.loads((out / "training_log.json").read_text())
    assert log["stages"]["dense"]["history"] and log["total_steps"] == 3
    assert json.loads((tmp_path / "training_log.json").read_text()) == log
    with tarfile.open(tmp_path / "tiny.tar") as tar:
        assert "tiny/training_log.json" in tar.getnames()
    config, meta = read_config(out)
    assert config.attention == "sparse" and config.dtype == "float32"
    assert meta["data"]["python_version"] and meta["data"]["heldout_files"]
    assert meta["training"]["stages"]["dense"]["steps_done"] == 2
    assert "--steps dense=2,dense_long=0,indexer_warmup=1" in meta["training"]["reproduce"]
    assert meta["training"]["stages"]["dense_long"]["stopped_by"] == "skipped"
    assert TrainingConfig.from_dict(meta["train_config"]) == load_config(TINY,
                                                                         ["data.max_files=24"])
    assert log["config"] == meta["train_config"]


@pytest.mark.slow
def test_init_from_a_checkpoint_trains_only_the_stage_and_keeps_the_lineage(tmp_path):
    parent = tmp_path / "parent"
    Trainer(_cfg(), parent, log=QUIET).run()
    cfg = load_config(TINY, ["data.max_files=24", "train.eval_batches=0",
                             "stages.dense.steps=0", "stages.dense_long.steps=0",
                             "stages.indexer_warmup.steps=2", f"init_from={parent}",
                             "model.preset=", "model.overrides.index_rope_scaling=2.0"])
    log = Trainer(cfg, tmp_path / "child", log=QUIET).run()
    assert log["total_steps"] == 6 + 2  # the parent's count continues
    before, _ = _params(parent)
    after, meta = _params(tmp_path / "child")
    model, _, _ = restore_checkpoint(tmp_path / "child")
    assert model.config.index_rope_scaling == 2.0
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]]
    changed = {p for p, x, y in zip(paths, before, after) if not np.array_equal(x, y)}
    assert changed and all("indexer" in p for p in changed)
    assert pathlib.Path(meta["init_from"]["path"]).resolve() == parent.resolve()
    assert meta["init_from"]["training"]["total_steps"] == 6


def test_init_from_must_name_a_checkpoint(tmp_path):
    for value, message in (("", "init_from must name a checkpoint directory"),
                           (str(tmp_path), "init_from: no checkpoint in")):
        cfg = load_config(TINY, [f"init_from={value}", "model.preset="])
        with pytest.raises(ValueError, match=message):
            Trainer(cfg, tmp_path / "out", log=QUIET)
    with pytest.raises(ValueError, match="either init_from or model.preset"):
        Trainer(load_config(TINY, [f"init_from={tmp_path}"]), tmp_path / "out", log=QUIET)
