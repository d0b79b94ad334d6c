"""`python -m experiments.benchmarks.prefill` times indexer variants side by side (tiny sizes)."""

import json

import pytest

from experiments.benchmarks import prefill as bench_prefill


@pytest.mark.slow
def test_variants_are_timed_side_by_side(tmp_path, capsys):
    rows = bench_prefill.main(["--preset", "tiny", "--lengths", "64,100", "--repeats", "1",
                               "--indexers", "flat,hierarchical,hierarchical:1",
                               "--out", str(tmp_path)])
    assert [r["tokens"] for r in rows] == [64, 100]
    for row in rows:
        assert set(row["seconds"]) == {"flat", "hierarchical", "hierarchical:1"}
    saved = json.loads((tmp_path / "bench_prefill_tiny_sparse.json").read_text())
    assert saved["variants"]["hierarchical:1"]["flat_index_layers"] == [1]
    assert saved["variants"]["hierarchical"]["flat_index_layers"] == []
    assert "flat/hierarchical:1" in capsys.readouterr().out


def test_parse_variant():
    assert bench_prefill.parse_variant("hierarchical:0:2", 4) == dict(
        indexer="hierarchical", flat_index_layers=(0, 2))
    assert bench_prefill.parse_variant(" flat", 4) == dict(indexer="flat", flat_index_layers=())
    for bad in ("flat:0", "sparse", "hierarchical:x"):
        with pytest.raises(ValueError, match="indexer variant"):
            bench_prefill.parse_variant(bad, 4)


@pytest.mark.parametrize("spec, message", [
    ("dense", "indexer variant must be one of ('flat', 'hierarchical'"),
    ("hierarchical:9",
     "flat_index_layers must be distinct layer indices in [0, n_layers - 1 = 1]")])
def test_bad_variants_exit_with_a_message(spec, message, capsys):
    with pytest.raises(SystemExit):
        bench_prefill.main(["--preset", "tiny", "--lengths", "64", "--indexers", spec])
    assert message in capsys.readouterr().err
