"""The prepared GPU run's pieces on this CPU: experiments.benchmarks.gpu_ttft measures the
`small` model end to end (every executable compiled before the timing, none while timed,
recall and decode recorded), and experiments.gpu_run runs its steps as child processes
under their timeouts, keeping each step's record."""

import json

import pytest

from experiments import gpu_run
from experiments.benchmarks import gpu_ttft


@pytest.mark.slow
def test_gpu_ttft_measures_with_every_step_compiled_before_timing(tmp_path):
    payload = gpu_ttft.main(["--model", "small", "--lengths", "1024,2048",
                             "--fidelity-positions", "64", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_ttft.json").read_text())["rows"] == payload["rows"]
    assert [r["length"] for r in payload["rows"]] == [1021, 2045]
    assert all(r["backend_compiles_while_timed"] == 0 for r in payload["rows"])
    assert payload["backend_compiles"]["before_timing"] >= payload["executables"] - 2
    assert all(0.0 <= r["recall"] <= 1.0 and r["flat_ms"] > 0 for r in payload["rows"])
    assert len(payload["rows"][-1]["decode_ms"]["hierarchical"]) == 2


def test_distinct_steps_share_executables_across_lengths():

    from model import ModelRunner
    from model.presets import get_config

    config = get_config("small").replace(max_seq_len=8192, prefill_chunk=1024)
    runner = ModelRunner.abstract(config)
    common = ["--model", "small", "--decode-steps", "2", "--fidelity-positions", "64"]
    one = gpu_ttft.distinct_steps(runner, gpu_ttft.parse_args([*common, "--lengths", "8192"]))
    both = gpu_ttft.distinct_steps(runner, gpu_ttft.parse_args([*common, "--lengths",
                                                                "4096,8192"]))
    # The shorter prefill adds only its captured last chunk.
    assert len(both) == len(one) + 1 and set(one) <= set(both)
    assert (1, 8192, False, ()) in one  # the decode step


def test_gpu_run_keeps_each_step_record(tmp_path, monkeypatch):
    child = "tests.experiments.gpu_run_child"
    monkeypatch.setattr(gpu_run, "STEPS", (
        gpu_run.Step("kernels", 60, (child, "exit", "0"), (child, "exit", "3"), 60),
        gpu_run.Step("v32", 60, (child, "exit", "0"), (child, "sleep", "30"), 1),
    ))
    report = gpu_run.main(["--compile-only", "--target", "h100", "--out", str(tmp_path)])
    first, second = report["steps"]
    assert first["exit"] == 3 and not first["timed_out"]  # the rehearsal's command ran
    assert second["timed_out"] and second["exit"] is None and second["timeout_s"] == 1
    assert "--target h100" in second["command"]
    assert json.loads((tmp_path / "gpu_run.json").read_text())["steps"] == report["steps"]
    assert "child exit 3" in (tmp_path / "kernels.log").read_text()
    with pytest.raises(SystemExit):
        gpu_run.parse_args(["--compile-only"])  # a rehearsal names its target
