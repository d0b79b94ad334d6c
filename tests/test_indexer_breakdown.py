"""`python -m experiments.indexer_breakdown --smoke`: every step timed, FLOPs counted."""

import json

import pytest

from experiments import indexer_breakdown


def test_breakdown_smoke(tmp_path, capsys):
    out = tmp_path / "breakdown.json"
    result = indexer_breakdown.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    (row,) = result["rows"]
    steps = {"coarse", "spread", "select", "table", "fine", "rank", "flat scores",
             "flat top_k", "hierarchical_topk", "flat_topk"}
    assert set(row["seconds"]) == steps
    assert all(row["seconds"][s] > 0 for s in steps - {"rank"})  # rank is a difference
    # Smoke config: 64 queries at 300 tokens, blocks of 16 (19 blocks), 2 heads of 16 dims.
    assert row["gflop"]["flat scores"] == pytest.approx(2 * 2 * 16 * 300 * 64 / 1e9)
    assert row["gflop"]["coarse"] == pytest.approx(2 * 2 * 16 * 19 * 64 / 1e9)
    assert "| 300 | select |" in capsys.readouterr().out


def test_queries_must_fill_whole_chunks():
    with pytest.raises(SystemExit):
        indexer_breakdown.main(["--lengths", "4096", "--queries", "100"])
