"""`python -m experiments.benchmarks.indexer --smoke` runs end to end on tiny sizes."""

import json

import numpy as np
import pytest

from experiments.benchmarks import indexer as bench_indexer
from experiments.benchmarks.indexer_real import with_flat_layers
from experiments.common import parse_layers
from model import get_config


@pytest.mark.slow
def test_bench_indexer_smoke(tmp_path, capsys):
    result = bench_indexer.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_indexer.json").read_text())
    assert saved["setup"]["smoke"] and [r["length"] for r in saved["lengths"]] == [512]
    for row in result["lengths"]:
        assert row["flop_ratio"] > 1
        for kind in ("random", "structured"):
            r = row[kind]
            assert r["speedup"] == pytest.approx(r["flat_s"] / r["hierarchical_s"])
            assert 0 <= r["recall"] <= 1
        assert row["structured"]["exact_equals_flat"]
    decode = saved["decode"]
    assert decode["speedup"] == pytest.approx(decode["flat_s"] / decode["hierarchical_s"])
    # The shipped model's own indexer inputs (1K tokens): every budget's recall is at most
    # the block ceiling; the largest budget covers the whole context; exact mode equals flat.
    real = saved["real"]
    (row,) = real["rows"]
    assert row["length"] == 1024 and len(row["layers"]) == 4 and row["exact_equals_flat"]
    for b in row["budgets"].values():
        assert 0 < b["recall"] <= b["ceiling"] + 1e-9
    assert row["budgets"]["1024"]["ceiling"] == 1.0
    # Layer 0 kept flat (the default --real-flat-layers): its recall counts as 1.
    for b in row["budgets"].values():
        mixed = b["with_flat_layers"]
        assert mixed["layers"] == [0]
        assert abs(mixed["recall"] - np.mean([1.0] + b["recall_per_layer"][1:])) < 1e-9
        assert mixed["recall"] >= b["recall"]
    printed = capsys.readouterr().out
    assert "| L | input | flat s | hier s | speedup |" in printed and "Decode step" in printed
    assert "Trained model's own indexer inputs" in printed and "layers 0 flat" in printed


def test_with_flat_layers_uses_the_flat_time_and_full_recall_of_those_layers():
    per_layer = [{"flat_s": 4.0, "budgets": {64: {"hierarchical_s": 1.0, "recall": 0.5}}},
                 {"flat_s": 4.0, "budgets": {64: {"hierarchical_s": 2.0, "recall": 0.9}}}]
    mixed = with_flat_layers(per_layer, 64, (0,))
    assert mixed == {"layers": [0], "speedup": 8.0 / 6.0, "recall": (1.0 + 0.9) / 2}
    assert parse_layers(" 1,0") == (1, 0) and parse_layers("none") == () == parse_layers("")
    with pytest.raises(ValueError, match="expected comma-separated layer indices or 'none'"):
        parse_layers("first")
    # The range is ModelConfig's check, as bench_real applies it.
    with pytest.raises(ValueError, match=r"flat_index_layers must be distinct layer indices in "
                                         r"\[0, n_layers - 1 = 1\]"):
        get_config("tiny").replace(flat_index_layers=parse_layers("2"))
    with pytest.raises(SystemExit):
        bench_indexer.main(["--smoke", "--real-flat-layers", "first"])
