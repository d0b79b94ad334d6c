"""`python -m experiments.benchmarks.selection_memory`: flat (as it ran before the xla path's
budgeted steps, and now) and streaming selection compiled side by side, their peak memory
read from XLA, their indices compared (tiny sizes)."""

import json

import pytest

from experiments.benchmarks import selection_memory


@pytest.mark.slow
def test_budgeted_steps_need_less_memory_for_the_same_indices(tmp_path):
    out = selection_memory.main(["--preset", "tiny", "--context", "12000", "--queries", "96",
                                 "--repeats", "1", "--out", str(tmp_path)])
    assert out["identical_rows"] == {"flat": 96, "streaming": 96}
    assert all(out["equal_up_to_ties"].values())
    former = out["kinds"]["flat_512"]
    for kind in ("flat", "streaming"):  # 96 queries: 64-query steps against one of 96
        assert out["kinds"][kind]["selection_peak_bytes"] < former["selection_peak_bytes"]
        assert out["vs_flat_512"][kind]["selection_memory"] > 1
    assert json.loads((tmp_path / "selection_memory.json").read_text())["queries"] == 96


def test_queries_must_fit_the_context():
    with pytest.raises(SystemExit):
        selection_memory.main(["--context", "100", "--queries", "200"])
