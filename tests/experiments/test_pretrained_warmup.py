"""The pretrained indexer warm-up on a tiny Llama GGUF: a second stage on longer windows
starts from the first stage's indexer and carries its record."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from experiments.training import warmup
from tests.pretrained_files import tiny_training_setup


@pytest.mark.slow  # two tiny warm-up runs with their compilations
def test_second_stage_starts_from_the_first_and_keeps_its_record(tmp_path, monkeypatch):
    gguf = tiny_training_setup(tmp_path, monkeypatch, warmup)
    out = tmp_path / "indexer"
    warmup.main(["--model", gguf, "--out", str(out), "--steps", "2", "--seq-len", "64",
                 "--warmup-steps", "1", "--heldout-every", "1"])
    first = load_file(str(out / "indexer.safetensors"))
    warmup.main(["--model", gguf, "--init", str(out), "--out", str(out), "--work",
                 str(tmp_path / "stage2.work"), "--steps", "1", "--seq-len", "128",
                 "--warmup-steps", "1", "--heldout-every", "1"])
    second = load_file(str(out / "indexer.safetensors"))
    assert first.keys() == second.keys()
    assert any(not np.array_equal(first[k], second[k]) for k in first)

    log = json.loads((out / "warmup_log.json").read_text())
    assert log["seq_len"] == 128 and log["steps"] == 1
    assert [(s["seq_len"], s["steps"]) for s in log["previous"]] == [(64, 2)]
    assert len(log["previous"][0]["train"]) == 2
    # stage 2's step-0 held-out KL is stage 1's indexer on the longer window
    assert log["heldout_kl"][0][0] == 0 and np.isfinite(log["heldout_kl"][0][1])
    meta = json.loads((out / "dsa.json").read_text())["metadata"]["warmup"]
    assert meta["previous_stages"][0]["seq_len"] == 64
    assert "train" not in meta["previous_stages"][0]
    assert (out / "warmup_curve.png").stat().st_size > 0
