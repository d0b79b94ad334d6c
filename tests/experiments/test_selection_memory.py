"""`python -m experiments.benchmarks.selection_memory`: flat and streaming selection compiled
side by side, their peak memory read from XLA, their indices compared (tiny sizes)."""

import json

import pytest

from experiments.benchmarks import selection_memory


@pytest.mark.slow
def test_streaming_needs_less_memory_for_the_same_indices(tmp_path):
    out = selection_memory.main(["--preset", "tiny", "--context", "12000", "--queries", "96",
                                 "--repeats", "1", "--out", str(tmp_path)])
    assert out["identical_rows"] == 96 and out["equal_up_to_ties"]
    flat, streaming = out["kinds"]["flat"], out["kinds"]["streaming"]
    assert streaming["selection_peak_bytes"] < flat["selection_peak_bytes"]
    assert json.loads((tmp_path / "selection_memory.json").read_text())["queries"] == 96


def test_queries_must_fit_the_context():
    with pytest.raises(SystemExit):
        selection_memory.main(["--context", "100", "--queries", "200"])
