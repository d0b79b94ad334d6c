"""`python -m experiments.bench_indexer --smoke` runs end to end on tiny sizes."""

import json

from experiments import bench_indexer


def test_bench_indexer_smoke(tmp_path, capsys):
    out = tmp_path / "bench_indexer.json"
    result = bench_indexer.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["setup"]["smoke"] and [r["length"] for r in saved["lengths"]] == [512]
    for row in result["lengths"]:
        assert row["flop_ratio"] > 1
        for kind in ("random", "structured"):
            r = row[kind]
            assert r["flat_s"] > 0 and r["hierarchical_s"] > 0 and 0 <= r["recall"] <= 1
        assert row["structured"]["exact_equals_flat"]
    assert saved["decode"]["flat_s"] > 0 and saved["decode"]["hierarchical_s"] > 0
    # The shipped model's own indexer inputs (1K tokens): every budget's recall is at most
    # the block ceiling; the largest budget covers the whole context; exact mode equals flat.
    real = saved["real"]
    (row,) = real["rows"]
    assert row["length"] == 1024 and len(row["layers"]) == 4 and row["exact_equals_flat"]
    for tokens, b in row["budgets"].items():
        assert 0 < b["recall"] <= b["ceiling"] + 1e-9 and b["hierarchical_s"] > 0
    assert row["budgets"]["1024"]["ceiling"] == 1.0
    printed = capsys.readouterr().out
    assert "| L | input | flat s | hier s | speedup |" in printed and "Decode step" in printed
    assert "Trained model's own indexer inputs" in printed
