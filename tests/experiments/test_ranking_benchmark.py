"""The ranking benchmark on tiny rows: every ranker present, the threshold agrees."""

import json

from experiments.benchmarks import ranking


def test_ranking_benchmark_writes_agreeing_rows(tmp_path):
    result = ranking.main(["--widths", "80,200", "--top-k", "16", "--steps", "1",
                           "--repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "ranking.json").read_text())
    assert [r["width"] for r in saved["widths"]] == [80, 200]
    for row in result["widths"]:
        assert set(ranking.RANKERS) <= set(row)
        assert row["lax.top_k"]["max_value_error"] == 0.0
        assert row["newest first"]["max_value_error"] == 0.0
        assert row["threshold"]["max_value_error"] < 1e-3
        assert all(row[n]["ms_per_1024_rows"] > 0 for n in ranking.RANKERS)
    assert "| 200 |" in (tmp_path / "ranking.md").read_text()
