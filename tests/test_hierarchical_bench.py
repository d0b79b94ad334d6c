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
    printed = capsys.readouterr().out
    assert "| L | input | flat s | hier s | speedup |" in printed and "Decode step" in printed
