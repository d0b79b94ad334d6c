"""The selection pipeline benchmark (python -m experiments.benchmarks.kernels): its pipelines
are the library's selections, and its CPU smoke run writes a path-free JSON report."""

import json

import numpy as np
import pytest

import indexer
from experiments.benchmarks import kernels


def _selected_scores(scores, indices):
    """Each row's selected scores, sorted (tie-proof: ReLU makes exact-zero ties common)."""
    scores, indices = np.asarray(scores), np.asarray(indices)
    vals = np.where(indices >= 0, np.take_along_axis(scores, np.maximum(indices, 0), 1),
                    -np.inf)
    return np.sort(vals, axis=1)


@pytest.mark.parametrize("cand_factor,covers_all",
                         [(4, True), pytest.param(1, False, marks=pytest.mark.slow)])
def test_hierarchical_pipeline_is_flat_iff_candidates_cover_every_block(cand_factor,
                                                                       covers_all):
    """L=64 keys in 4 blocks of 16, top_k=16: a budget of 4 x 16 tokens covers every block,
    so hierarchical selects what flat does (up to ties); 1 x 16 tokens (raised to the sink
    and 2 local blocks) leaves a block out for the last queries, and the selections differ."""
    L = 64
    args = kernels.parse_args(["--smoke", "--backend", "xla", "--lengths", str(L),
                               "--chunk", "64", "--top-k", "16",
                               "--cand-factor", str(cand_factor)])
    config = kernels.hierarchical_config(args)
    assert config.candidate_tokens == cand_factor * 16 and config.block_size == args.block
    q, w, k = kernels.random_inputs(L, args.heads, args.dim, seed=3)
    fns = kernels.pipelines(args, config)
    flat, hier = fns["flat"](q, w, k), fns["hierarchical"](q, w, k)
    np.testing.assert_array_equal(np.asarray(flat), np.asarray(indexer.flat_topk(
        q, w, k, 16, backend="xla")))
    scores = indexer.index_scores(q, w, k, backend="xla")
    same = np.allclose(_selected_scores(scores, hier), _selected_scores(scores, flat),
                       rtol=1e-6)
    assert same == covers_all
    valid = np.asarray((np.asarray(hier) >= 0).sum(axis=1))
    np.testing.assert_array_equal(valid, np.minimum(16, np.arange(L) + 1))
    row_max = np.asarray(fns["scores"](q, w, k)).reshape(L)
    np.testing.assert_allclose(row_max, np.asarray(scores).max(axis=1), rtol=1e-6)


def test_lengths_must_be_multiples_of_the_chunk():
    with pytest.raises(SystemExit):
        kernels.parse_args(["--smoke", "--lengths", "200", "--chunk", "128"])
    with pytest.raises(SystemExit):  # candidate budget below top_k: HierarchicalConfig refuses
        kernels.parse_args(["--smoke", "--cand-factor", "0"])


@pytest.mark.slow
def test_smoke_run_writes_json(tmp_path, capsys):
    out = tmp_path / "nested"
    result = kernels.main(["--smoke", "--out", str(out)])
    text = (out / "bench_kernels.json").read_text()
    saved = json.loads(text)
    assert saved == json.loads(json.dumps(result))
    assert str(tmp_path) not in text and "out" not in saved["args"]
    assert saved["errors"] == [] and saved["smoke"] is True
    assert saved["backend"] == "interpret"
    timed = {r["pipeline"]: r for r in saved["rows"] if "time_s" in r}
    assert set(timed) == {"scores", "flat", "hierarchical"}
    (summary,) = [r for r in saved["rows"] if r["pipeline"] == "flat vs hierarchical"]
    assert summary["speedup"] == pytest.approx(
        timed["flat"]["time_s"] / timed["hierarchical"]["time_s"], abs=1e-3)
    # Random inputs, half the blocks as candidates: hierarchical misses some flat picks.
    assert 0.0 < summary["recall"] < 1.0
    assert saved["hierarchical_config"]["candidate_tokens"] == 4 * saved["args"]["top_k"]
    assert "NOT performance figures" in capsys.readouterr().out
