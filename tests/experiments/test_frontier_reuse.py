"""The frontier's reuse rows: a shared layer costs nothing and is scored against its own flat."""

import numpy as np
import pytest

from experiments.benchmarks.frontier import reuse_rows
from indexer import recall
from model import get_config


def _selections(rng, n_layers, queries=8, top_k=4, length=64):
    def pick():
        return np.stack([rng.choice(length, top_k, replace=False) for _ in range(queries)])
    return [{"flat": pick(), "mean/fixed/16": pick()} for _ in range(n_layers)]


def test_reuse_rows_cost_only_full_layers_and_score_against_each_layers_own_flat():
    config = get_config("tiny").replace(n_layers=4)
    rng = np.random.default_rng(0)
    selections = _selections(rng, 4)
    per_layer = [{"flat_s": 1.0 + i, "mean/fixed/16": {"time_s": 0.25 * (1 + i)}}
                 for i in range(4)]
    runs = {"mean/fixed/16": ("mean", "fixed", 16, None), "mean/mass/0.9": ("mean", "mass",
                                                                            0.9, None)}
    rows = reuse_rows(2048, per_layer, selections, runs, ["FFFF", "FSFS", "freq4"], config,
                      fastest_s=10.0)
    by = {r["name"]: r for r in rows}
    assert set(by) == {f"{run}@{p}" for run in ("flat", "mean/fixed/16")
                       for p in ("FFFF", "FSFS", "freq4")}  # mass rows get no reuse rows
    assert by["flat@FFFF"]["recall"] == 1.0 and by["flat@FFFF"]["speedup"] == pytest.approx(1.0)
    fsfs = by["flat@FSFS"]
    assert fsfs["indexers"] == 2 and fsfs["hierarchical_s"] == pytest.approx(1.0 + 3.0)
    want = [1.0, recall(selections[0]["flat"], selections[1]["flat"]), 1.0,
            recall(selections[2]["flat"], selections[3]["flat"])]
    assert fsfs["recall_per_layer"] == pytest.approx(want) and fsfs["recall"] < 1.0
    hier = by["mean/fixed/16@freq4"]
    assert hier["indexers"] == 1 and hier["speedup"] == pytest.approx(10.0 / 0.25)
    assert hier["recall_per_layer"][3] == pytest.approx(
        recall(selections[0]["mean/fixed/16"], selections[3]["flat"]))
