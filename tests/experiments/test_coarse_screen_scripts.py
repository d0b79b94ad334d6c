"""End-to-end: distil coarse screens for the shipped model, then its frontier benchmark."""

import json
import shutil

import pytest

from experiments.benchmarks import frontier
from experiments.training import coarse_screen
from model.checkpoint import DEFAULT_CHECKPOINT, has_checkpoint


@pytest.mark.slow
@pytest.mark.skipif(not has_checkpoint(DEFAULT_CHECKPOINT), reason="no shipped checkpoint")
def test_distil_then_frontier(tmp_path):
    ckpt = tmp_path / "small"
    shutil.copytree(DEFAULT_CHECKPOINT, ckpt, ignore=shutil.ignore_patterns("coarse_screen*"))
    coarse_screen.main(["--checkpoint", str(ckpt), "--out", str(ckpt), "--length", "1024",
                        "--sequences", "1", "--queries", "128", "--steps", "5"])
    log = json.loads((ckpt / "coarse_screen_log.json").read_text())
    assert len(log["layers"]) == 4
    assert all(e["train_loss_last"] < e["train_loss_first"] for e in log["layers"])
    out = tmp_path / "frontier"
    frontier.main(["--checkpoint", str(ckpt), "--lengths", "1000", "--queries", "64",
                   "--budgets", "256,512", "--masses", "0.9", "--ratios", "0.5",
                   "--extra", "exact:candidate_tokens=256,exact=true;tight:"
                   "candidate_tokens=512,tile_candidate_tokens=512;b32:candidate_tokens=256,block_size=32",
                   "--streaming-tiles", "300", "--reuse", "freq2", "--repeats", "1",
                   "--offset", "3000",                   "--out", str(out)])
    result = json.loads((out / "frontier.json").read_text())
    rows = result["lengths"][0]["rows"]
    streaming = [r for r in rows if r["method"] == "streaming"]
    assert len(streaming) == 1 and streaming[0]["equal"] and streaming[0]["recall"] == 1.0
    threshold = [r for r in rows if r["method"] == "flat" and not r.get("reuse")]
    assert [r["rule"] for r in threshold] == ["threshold"]
    assert threshold[0]["recall"] > 0.99  # the same sets up to near-ties
    assert result["offset"] == 3000
    assert result["lengths"][0]["fastest_exact"] in ("flat", "flat/threshold", "streaming/300")
    reused = {r["name"]: r for r in rows if r.get("reuse")}
    assert set(reused) == {"flat@freq2", "mean/fixed/256@freq2", "mean/fixed/512@freq2",
                           "learned/fixed/256@freq2", "learned/fixed/512@freq2"}
    assert all(r["indexers"] == 2 for r in reused.values())
    assert reused["flat@freq2"]["recall_per_layer"][0] == 1.0
    assert reused["flat@freq2"]["recall"] < 1.0  # layer 1 reads layer 0's selection
    rows = [r for r in rows if r["method"] not in ("streaming", "flat") and not r.get("reuse")]
    assert {r["method"] for r in rows} == {"mean", "learned"}
    assert {r["rule"] for r in rows} == {"fixed", "mass", "ratio", "exact", "tight", "b32"}
    assert [r["method"] for r in rows if r["rule"] == "b32"] == ["mean"]
    for r in rows:
        if r["rule"] == "exact":  # certified equal to flat; "scored" says where it pruned
            assert r["recall"] == pytest.approx(1.0) and 0 < r["scored"] <= 1
            assert r["ceiling"] is None
        if r["rule"] in ("tight", "b32"):  # b32: blocks of 32, their own summaries
            assert 0 < r["ceiling"] <= 1
    for r in rows:
        assert 0 < r["recall"] <= 1 and r["speedup"] > 0
        if r["rule"] == "fixed":
            assert r["recall"] <= r["ceiling"] + 1e-9  # no block selector beats it
    assert (out / "frontier.png").stat().st_size > 0 and (out / "frontier.md").is_file()
