"""`python -m experiments.benchmarks.indexer_breakdown --smoke`: every step timed, FLOPs counted."""

import json

import pytest

from experiments.benchmarks import indexer_breakdown


@pytest.mark.slow
def test_breakdown_smoke(tmp_path, capsys):
    result = indexer_breakdown.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "indexer_breakdown.json").read_text())
    assert saved["rows"] == result["rows"]
    (row,) = result["rows"]
    steps = {"coarse", "spread", "select", "table", "fine", "rank", "flat scores",
             "flat top_k", "hierarchical_topk", "flat_topk"}
    assert set(row["seconds"]) == steps
    # Smoke config: 64 queries at 300 tokens, blocks of 16 (19 blocks), 2 heads of 16 dims.
    assert row["gflop"]["flat scores"] == pytest.approx(2 * 2 * 16 * 300 * 64 / 1e9)
    assert row["gflop"]["coarse"] == pytest.approx(2 * 2 * 16 * 19 * 64 / 1e9)
    assert "| 300 | select |" in capsys.readouterr().out


def test_queries_must_fill_whole_chunks():
    with pytest.raises(SystemExit):
        indexer_breakdown.main(["--lengths", "4096", "--queries", "100"])
