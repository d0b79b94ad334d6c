"""`python -m experiments.benchmarks.v4_entries` on tiny sizes: a budget that holds every
entry recalls flat's entries exactly and agrees on every greedy token; a smaller one ranks
a share below 1; the timing part times both kinds."""

import json

import pytest

from experiments.benchmarks import v4_entries


@pytest.mark.slow
def test_recall_and_timing_parts_on_tiny_sizes(tmp_path):
    out = v4_entries.main(["--tokens", "512", "--budgets", "16,128", "--block", "4",
                           "--settings", "query_tile=1", "--contexts", "4096",
                           "--queries", "64", "--repeats", "1", "--timing-budget", "512",
                           "--out", str(tmp_path)])
    small, whole = out["recall"]["rows"]
    assert out["recall"]["entries"] == 128 and out["recall"]["family"] == "deepseek_v4"
    assert whole["recall"] == 1.0 and whole["greedy_agreement"] == 1.0
    assert whole["scored_share"] == 1.0
    assert 0 < small["recall"] <= 1 and small["scored_share"] < 0.5
    (row,) = out["timing"]["rows"]
    assert row["entries"] == 1024 and row["flat_s"] > 0 and row["hierarchical_s"] > 0
    assert 0 < row["scored_share"] <= 1
    assert json.loads((tmp_path / "v4_entries.json").read_text())["command"].startswith(
        "python -m experiments.benchmarks.v4_entries")
