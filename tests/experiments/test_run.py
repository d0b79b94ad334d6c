"""`python -m experiments.run`: the TTFT study's results.json schema on a tiny config, the
split's arithmetic, the report, and usage errors for bad configs."""

import json
import pathlib

import pytest
import yaml

from experiments import run as main_job
from experiments.ttft import plan
from experiments.ttft.config import RunConfig, load_run_config

TINY = {"model": {"checkpoint": None}, "lengths": [256, 320],
        "modes": [{"name": "sparse-flat", "attention": "sparse", "indexer": "flat"},
                  {"name": "sparse-hierarchical", "attention": "sparse",
                   "indexer": "hierarchical"},
                  {"name": "dense", "attention": "dense", "time_max_length": 256}],
        "repetitions": 2, "fidelity_positions": 64, "decode_steps": 2}
RUN_KEYS = {"context_len", "mode", "ttft_ms", "indexer_ms", "attention_ms", "other_ms",
            "indexer_share", "recall", "iou", "top1_agreement", "logit_kl"}


def _config(tmp_path, data):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    main_job.main(["--config", _config(tmp, TINY), "--out", str(tmp / "out")])
    return tmp / "out"


@pytest.mark.slow
def test_results_json_schema(tiny_results):
    results = json.loads((tiny_results / "results.json").read_text())
    assert set(results) >= {"config", "env", "runs", "summary"}
    assert set(results["env"]) >= {"jax", "backend", "device"}
    assert [(r["context_len"], r["mode"]) for r in results["runs"]] == [
        (L, m) for L in (256, 320) for m in ("sparse-flat", "sparse-hierarchical", "dense")]
    # Every program compiled before its length was timed; the longer length compiled only
    # what the shorter did not (its captured last chunks and their logits rows).
    compiles = results["summary"]["compiles"]["per_length"]
    assert [c["compiles_while_timed"] for c in compiles.values()] == [0, 0]
    untimed = results["runs"][-1]  # dense at 320: past its time_max_length
    assert untimed["ttft_ms"] is None and untimed["timed"] is False
    assert untimed["top1_agreement"] is not None and untimed["perplexity"] > 1
    assert all(r["perplexity_vs_dense"] is not None for r in results["runs"][3:5])
    for r in results["runs"][:-1]:
        assert RUN_KEYS <= set(r)
        assert set(r["ttft_ms"]) >= {"median", "min", "max"} and len(r["ttft_ms"]["runs"]) == 2
        assert r["ttft_ms"]["min"] <= r["ttft_ms"]["median"] <= r["ttft_ms"]["max"]
        # other is the remainder of the measured TTFT: the parts add up to it.
        parts = r["indexer_ms"] + r["attention_ms"] + r["other_ms"]
        # of the fastest run (the modes were timed interleaved, the split is from the mins)
        assert parts == pytest.approx(r["ttft_ms"]["min"])
        assert r["indexer_share"] == pytest.approx(r["indexer_ms"] / r["ttft_ms"]["min"])
    flat, hier, dense = results["runs"][3:]
    assert flat["recall"] is None and flat["top1_agreement"] is None  # the reference itself
    assert 0 < hier["recall"] <= 1 and 0 < hier["iou"] <= hier["recall"]
    assert 0 <= hier["top1_agreement"] <= 1 and hier["logit_kl"] >= 0
    assert results["runs"][2]["indexer_ms"] == 0 and dense["recall"] is None
    assert dense["top1_agreement"] is not None and flat["top1_agreement_vs_dense"] is not None
    s = results["summary"]
    assert s["context_len"] == 320
    assert s["ttft_ratio"] == pytest.approx(hier["ttft_ms"]["min"] / flat["ttft_ms"]["min"])
    assert s["ttft_ratio_median"] == pytest.approx(hier["ttft_ms"]["median"]
                                                   / flat["ttft_ms"]["median"])
    assert s["recall"] == hier["recall"] and s["indexer_share_flat"] == flat["indexer_share"]
    assert [c["context_len"] for c in s["per_length"]] == [256, 320]
    assert 0 < s["scored_share"] == hier["scored_share"] <= 1
    # The machine's limit beside every timed row: model FLOPs over the fastest TTFT.
    rate = s["matmul_rate"]
    assert len(rate["measured_gflops"]) == 2 and rate["gflops"] == max(rate["measured_gflops"])
    for r in results["runs"][:-1]:
        # (results.json rounds its floats)
        assert r["achieved_gflops"] == pytest.approx(r["model_tflop"] * 1e3
                                                     / (r["ttft_ms"]["min"] / 1e3), rel=1e-3)
        assert r["matmul_share"] == pytest.approx(r["achieved_gflops"] / rate["gflops"],
                                                  rel=1e-3)


def test_plan_shares_programs_across_lengths():
    """One cache capacity for the study: a shorter length's chunks are the longer one's
    first, so the longer adds only the chunks that read past the shorter or carry its
    logits and captures."""
    from model import ModelRunner, get_config
    from model.runner import step_key

    run = RunConfig.from_dict({**TINY, "lengths": [2048, 4096]})
    config = get_config("tiny").replace(max_seq_len=8192, prefill_chunk=512)
    runners, keys = {}, []
    for length in run.lengths:
        planned = plan.plan_length(run, config, length)
        assert all(p.capacity == 4096 + 3 for p in planned.prefills())
        keys.append({(p.config, step_key(s)) for p in planned.prefills()
                     for s in runners.setdefault(p.config, ModelRunner.abstract(p.config))
                     .prefill_steps(p.n, **p.kwargs())})
    shorter, longer = keys
    new = longer - shorter
    assert new and all(key[1][1] > 2048 or key[1][2] or key[1][3] for key in new)
    assert len(shorter & longer) >= len(shorter) // 2


@pytest.mark.slow  # 20 s of compiles from a cold cache: the default tier's largest
def test_rehearse_compiles_each_program_once(monkeypatch):
    """--compile-only's rehearsal, with this CPU standing in for the GPU target: every
    program of every length compiled once; a program a longer length reuses lists both."""
    import time

    from model import get_config

    class CpuTarget:
        name, memory_bytes = "cpu", 1 << 34

        def compile(self, lower):
            t0 = time.perf_counter()
            return lower(lambda args: args).compile(), time.perf_counter() - t0

    run = RunConfig.from_dict({**TINY, "lengths": [256, 320], "decode_steps": 1})
    config = get_config("tiny").replace(max_seq_len=512, prefill_chunk=128)
    report = plan.rehearse(run, config, CpuTarget(), log=lambda line: None)
    rows, summary = report["executables"], report["summary"]
    keys = [(r["program"], r["step"], r["rows"], r["kv_len"], r["all_logits"],
             tuple(r["capture"])) for r in rows]
    assert len(keys) == len(set(keys)) == summary["executables"]
    assert any(r["lengths"] == [256, 320] for r in rows)  # reused by the longer length
    assert {r["program"] for r in rows} == {"sparse-flat", "sparse-hierarchical", "dense",
                                            f"window top_k {config.top_k}", "window top_k 1"}
    assert all(0 < r["peak_bytes"] <= r["held_bytes"] for r in rows) and summary["fits"]


@pytest.mark.slow
def test_report_and_plot_are_written(tiny_results):
    report = (tiny_results / "report.md").read_text()
    assert "| 320 | sparse-hierarchical |" in report
    assert "add up to the measured TTFT exactly" in report
    assert (tiny_results / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_config_loads_and_matches_the_documented_run():
    """The default runs the real model: SmolLM2 at 4K and 8K, one round, dense timed at 4K
    and run for its fidelity at 8K, hierarchical on a budget by length that scores at most
    half of the keys of the fidelity positions."""
    from experiments.ttft.measure import scored_share
    from model.pretrained.indexer_weights import read_indexer_meta
    from model.pretrained.registry import default_indexer_dir

    run = load_run_config(main_job.DEFAULT_CONFIG)
    assert run.model.pretrained == "smollm2-135m" and run.lengths == (4096, 8192)
    assert [m.name for m in run.modes] == ["sparse-flat", "sparse-hierarchical", "dense"]
    assert run.repetitions == 1 and run.split is False  # run_smollm2.yaml times the split
    dense = run.mode("dense")
    assert dense.timed(4096) and not dense.timed(8192) and dense.max_length is None
    base, _, _ = read_indexer_meta(default_indexer_dir("smollm2-135m"))
    hier = run.mode("sparse-hierarchical").model_config(base)
    # The shipped rule by length (dsa.json; the config says how it was found): about half
    # of the keys at 8K; at 4K no budget of half the keys reaches the recall floor.
    assert run.mode("sparse-hierarchical").hierarchical == {}
    assert hier.hierarchical.length_budgets == ((4096, 2560), (8192, 4096), (16384, 4608),
                                                (32768, 5120))
    assert hier.hierarchical.candidate_tokens is None
    assert 0.45 < scored_share(hier, 8192, run.fidelity_positions) < 0.55
    assert 0.5 < scored_share(hier, 4096, run.fidelity_positions) < 0.75
    small = load_run_config(pathlib.Path(main_job.DEFAULT_CONFIG).parent / "run_small.yaml")
    assert small.model.pretrained is None and small.lengths == (8192, 16384, 32768)
    assert small.mode("dense").max_length == 8192


def test_untimed_modes_run_once_without_a_split():
    """A mode past its time_max_length is planned (for its fidelity) without baselines or
    decode steps."""
    from model import get_config

    data = {**TINY, "modes": TINY["modes"][:2] + [{"name": "dense", "attention": "dense",
                                                    "time_max_length": 256}]}
    run = RunConfig.from_dict(data)
    config = get_config("tiny").replace(max_seq_len=512, prefill_chunk=128)
    short, long = (plan.plan_length(run, config, n) for n in (256, 320))
    assert short.untimed == frozenset() and long.untimed == {"dense"}
    assert "dense" in long.modes and set(long.baselines) == set(short.baselines)


def test_a_run_without_its_split_times_no_baselines_and_reports_ttft_alone(tmp_path):
    """split: false plans no window baselines; a timed row then has its TTFT and no split,
    and the report and plot say the split was not measured."""
    from types import SimpleNamespace

    from experiments.ttft import report
    from experiments.ttft.measure import mode_row
    from model import get_config

    run = RunConfig.from_dict({**TINY, "split": False})
    config = get_config("tiny").replace(max_seq_len=512, prefill_chunk=128)
    planned = plan.plan_length(run, config, 256)
    assert planned.baselines == {} and set(planned.modes) == {m["name"] for m in TINY["modes"]}
    assert plan.plan_length(RunConfig.from_dict(TINY), config, 256).baselines
    timer = SimpleNamespace(tokens=[0] * 256, stats=lambda: {"min": 10.0, "median": 11.0,
                                                             "max": 12.0, "runs": [10, 12]})
    spec, prefill = planned.modes["sparse-flat"]
    row = mode_row(spec, prefill.config, timer, SimpleNamespace(decode_ms=None), {})
    assert row["ttft_ms"]["min"] == 10.0 and row["timed"]
    assert row["indexer_ms"] is None and row["indexer_share"] is None
    results = {"command": "c", "model": "m", "wall_s": 1.0, "random_weights": False,
               "config": {"repetitions": 1, "split": False}, "runs": [row], "method": {},
               "env": {"device": "cpu", "backend": "cpu", "jax": "x"},
               "summary": {"context_len": 256, "per_length": [{
                   "context_len": 256, "compare": "h", "reference": "f", "ttft_ratio": 0.9,
                   "indexer_share_flat": None, "indexer_share_hierarchical": None}]}}
    row.update(model_tflop=0.5, achieved_gflops=50.0, matmul_share=0.25)
    results["summary"]["matmul_rate"] = {"gflops": 200.0, "shape": "f32 [8, 8] x [8, 8]",
                                          "measured_gflops": [190.0, 200.0]}
    text = report.markdown(results)
    assert "| 0.50 | 50.0 (0.25) |" in text and "at 200.0 GFLOP/s (measured 190.0 and" in text
    lines = report.console_lines(results)
    assert max(map(len, lines)) <= 80 and "256 sparse-flat" in lines[1]
    assert lines[1].split()[2:5] == ["0.01", "50.0", "0.25"]  # TTFT s, GFLOP/s, its share
    assert "Split: not measured" in text and "indexer share" not in text.split("|")[0]
    assert "= 0.900" in text and "each timed right after its own warm-up; ratios from" in text
    assert report.plot(results, tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="split must be"):
        RunConfig.from_dict({**TINY, "split": "no"})


@pytest.mark.parametrize("override, message", [
    ("lengths=[0]", "lengths must be a non-empty list of ints >= 2"),
    ("modes=[{name: a, indexer: exact}]", "modes[0].indexer must be one of"),
    ("reference=dense", "reference must be a sparse mode"),
    ("colour=blue", "unknown RunConfig fields ['colour']"),
    ("model.checkpoint=/nonexistent/dir", "no trained checkpoint at /nonexistent/dir"),
    ("modes=[{name: sparse-flat, hierarchical: {block_size: 0}}]",
     "sparse-flat: HierarchicalConfig.block_size"),
])
def test_bad_configs_are_usage_errors(override, message, capsys):
    small = str(pathlib.Path(main_job.DEFAULT_CONFIG).parent / "run_small.yaml")
    with pytest.raises(SystemExit) as info:
        main_job.main(["--config", small, "--set", "lengths=[256]", "--set",
                       "fidelity_positions=64",
                       "--set", "compare=sparse-flat", "--set", override])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_missing_config_file_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main_job.main(["--config", "nope.yaml"])
    assert "--config nope.yaml: no such file" in capsys.readouterr().err


def test_random_weights_need_a_preset():
    with pytest.raises(ValueError, match="model.preset together with model.random_weights"):
        RunConfig.from_dict({"model": {"random_weights": True}})


def test_h200_config_is_v32_shaped_with_four_layers():
    """run_h200.yaml names V3.2's true dimensions, cut to one dense and three MoE layers;
    the shapes come from nnx.eval_shape (the ~80 GB model is never allocated here)."""
    from flax import nnx

    from experiments.ttft.study import preset_config
    from model import Transformer

    run = load_run_config(pathlib.Path(main_job.DEFAULT_CONFIG).parent / "run_h200.yaml")
    assert run.model.preset == "deepseek-v3.2" and run.model.layers == (2, 3, 4, 5)
    config = preset_config(run.model, max(run.lengths) + run.decode_steps + 1)
    assert config.n_layers == 4 and config.moe.mlp_layer_types == ("dense",) + ("sparse",) * 3
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    dense, moe = model.layer(0), model.layer(1)
    assert dense.mlp.gate.kernel.shape == (7168, 18432)
    assert moe.mlp.gate.shape == (256, 7168, 2048) and moe.mlp.down.shape == (256, 2048, 7168)
    assert moe.mlp.shared.gate.kernel.shape == (7168, 2048)
    assert moe.attn.q_b.kernel.shape == (1536, 128 * 192)
    assert moe.attn.kv_a.kernel.shape == (7168, 512 + 64)
    assert moe.indexer.wq.kernel.shape == (1536, 64 * 128)  # wq_b, from the q-LoRA residual
    assert config.dtype == "bfloat16" and config.top_k == 2048
    plan.plan_length(run, config, max(run.lengths))  # its caches fit max_seq_len
    with pytest.raises(ValueError, match="max_seq_len=131072: raise max_seq_len"):
        plan.plan_length(run, config.replace(max_seq_len=131072), max(run.lengths))
    # run_h100.yaml: the same slice, its moe section changed only in fp8_block.
    h100 = load_run_config(pathlib.Path(main_job.DEFAULT_CONFIG).parent / "run_h100.yaml")
    fp8 = preset_config(h100.model, max(h100.lengths) + h100.decode_steps + 1)
    assert fp8 == config.replace(moe=config.moe.replace(fp8_block=(128, 128)))
    with pytest.raises(ValueError, match="layers must be None unless model.preset is set"):
        RunConfig.from_dict({"model": {"layers": [0]}})
    with pytest.raises(ValueError, match="layers must be a non-empty list of layer indices"):
        RunConfig.from_dict({"model": {"preset": "tiny", "random_weights": True,
                                       "layers": []}})


@pytest.mark.slow
def test_one_repetition_times_each_mode_after_its_own_warm_up(tmp_path):
    """With one repetition each mode and baseline is compiled, timed once and its programs
    freed before the next (study._time_length): still nothing compiles while timed, the
    split is complete and the study's caches are as long as it needs (8197 positions ->
    8448, not the 16384 of their power-of-two bucket)."""
    from model.buckets import cache_positions

    data = {**TINY, "lengths": [256], "repetitions": 1}
    results = main_job.main(["--config", _config(tmp_path, data), "--out",
                             str(tmp_path / "out")])
    counts = results["summary"]["compiles"]["per_length"]["256"]
    assert counts["compiles_while_timed"] == 0 and counts["compiles_before_timing"] > 0
    for row in results["runs"]:
        assert row["ttft_ms"]["min"] > 0 and len(row["ttft_ms"]["runs"]) == 1
        assert row["other_ms"] == row["baselines_ms"]["window_top_1"] > 0
    assert [cache_positions(n, exact=True) for n in (8197, 256, 257)] == [8448, 256, 512]
    assert cache_positions(8197) == 16384


def test_timing_is_interleaved_round_by_round():
    from experiments.ttft.measure import time_interleaved

    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def time_once(self):
            calls.append(self.name)

    time_interleaved([Fake("flat"), Fake("hier"), Fake("window")], 3)
    assert calls == ["flat", "hier", "window"] * 3


def test_smollm2_config_modes_apply_to_the_shipped_retrofit():
    """run_smollm2.yaml's modes are valid on SmolLM2's stored config (read without its
    weights): the reuse mode runs 15 of the 30 indexers, hierarchical keeps a budget below
    the 8K context, and dense is there for fidelity vs dense."""
    from model.pretrained.indexer_weights import read_indexer_meta
    from model.pretrained.registry import default_indexer_dir

    run = load_run_config(pathlib.Path(main_job.DEFAULT_CONFIG).parent / "run_smollm2.yaml")
    assert run.model.pretrained == "smollm2-135m" and run.lengths == (8192,)
    base, _, _ = read_indexer_meta(default_indexer_dir("smollm2-135m"))
    base = base.replace(**run.model.overrides)
    configs = {m.name: m.model_config(base) for m in run.modes}
    reuse = configs["sparse-hierarchical-freq2"]
    assert [reuse.layer_is_shared(i) for i in range(4)] == [False, True, False, True]
    assert sum(not reuse.layer_is_shared(i) for i in range(reuse.n_layers)) == 15
    assert configs["sparse-hierarchical"].hierarchical.budget_tokens(8192) == 4096  # dsa.json
    assert configs["dense"].attention == "dense" and run.reference == "sparse-flat"


@pytest.mark.parametrize("name", sorted(p.name for p in pathlib.Path(
    main_job.DEFAULT_CONFIG).parent.glob("run_*.yaml")))
def test_every_shipped_run_config_loads(name):
    run = load_run_config(pathlib.Path(main_job.DEFAULT_CONFIG).parent / name)
    assert run.lengths and run.mode(run.reference) and run.mode(run.compare)


@pytest.mark.slow
def test_the_default_config_runs_end_to_end_on_shortened_inputs(tmp_path):
    """The default main job (SmolLM2-135M with its shipped indexer, fetched on first use) on
    one short length (the CI's time: about 2 minutes of compiles and passes): flat and
    hierarchical timed, dense run once for its fidelity, the summary and the projection."""
    raw = yaml.safe_load(pathlib.Path(main_job.DEFAULT_CONFIG).read_text())
    raw.update(lengths=[1088], fidelity_positions=32, decode_steps=0)
    next(m for m in raw["modes"] if m["name"] == "dense")["time_max_length"] = 1024
    results = main_job.main(["--config", _config(tmp_path, raw), "--out", str(tmp_path / "o")])
    assert results["random_weights"] is False and "smollm2-135m" in results["model"]
    runs = {r["mode"]: r for r in results["runs"]}
    assert runs["dense"]["ttft_ms"] is None and runs["dense"]["top1_agreement"] is not None
    hier = runs["sparse-hierarchical"]
    assert 0.9 < hier["recall"] <= 1 and hier["perplexity_vs_dense"] is not None
    assert runs["sparse-flat"]["perplexity"] > 1 and hier["ttft_ms"]["min"] > 0
    assert hier["indexer_ms"] is None  # split: false, no window baselines
    assert [c["context_len"] for c in results["summary"]["per_length"]] == [1088]
    assert results["projection"]["rows"]
    assert "Projection (the plot's right panel" in (tmp_path / "o" / "report.md").read_text()


@pytest.mark.slow
def test_a_deepseek_v4_folder_runs_the_study_over_its_entries(tmp_path):
    """The main job on a DeepSeek-V4 folder (the tiny fixture): flat vs hierarchical
    selection over the CSA layers' compressed entries (1024 tokens: 256 entries, blocks of
    4, a budget of 64), the selections each pass captured compared over the CSA layers and
    the scored share counted in entries."""
    folder = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v4" / "tiny"
    raw = {"model": {"pretrained": str(folder)}, "lengths": [1024], "repetitions": 1,
           "fidelity_positions": 64, "decode_steps": 0, "split": False,
           "modes": [{"name": "sparse-flat", "attention": "sparse", "indexer": "flat"},
                     {"name": "sparse-hierarchical", "attention": "sparse",
                      "indexer": "hierarchical",
                      "hierarchical": {"block_size": 4, "candidate_tokens": 64,
                                       "query_tile": 1}}]}
    results = main_job.main(["--config", _config(tmp_path, raw), "--out", str(tmp_path / "o")])
    hier = {r["mode"]: r for r in results["runs"]}["sparse-hierarchical"]
    # 16 of the last query's 64 blocks, more of the earlier queries' fewer blocks.
    assert 0.25 < hier["scored_share"] < 0.3
    assert 0 < hier["recall"] <= 1 and 0 < hier["iou"] <= hier["recall"]
    assert hier["top1_agreement"] is not None and hier["ttft_ms"]["min"] > 0
