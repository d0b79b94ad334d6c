"""The kernel benchmark's CPU smoke run, and the selection pipelines it times."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bench, bench_support
from pallas_kernels.index_scores import index_scores_reference
from tests.test_kernels_common import indexer_inputs


def test_smoke_run_writes_json(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    data = bench.main(["--smoke", "--lengths", "256"])
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["errors"] == [] and data["errors"] == []
    assert {c["name"].split()[0] for c in saved["correctness"]} == {
        "index_scores", "gathered_index_scores", "sparse_attention", "api"}
    assert all(c["ok"] for c in saved["correctness"]), saved["correctness"]
    sections = {r["section"] for r in saved["results"]}
    assert sections == {"matmul", "scores", "select", "attention"}
    assert all(r["time_s"] is None or r["time_s"] > 0 for r in saved["results"])


def _selected_scores(scores, indices):
    """Each row's selected scores, sorted (tie-proof: ReLU makes exact-zero ties common)."""
    scores, indices = np.asarray(scores), np.asarray(indices)
    vals = np.where(indices >= 0, np.take_along_axis(scores, np.maximum(indices, 0), 1),
                    -np.inf)
    return np.sort(vals, axis=1)


def test_hierarchical_is_exact_when_candidates_cover_every_visible_block():
    """With a candidate budget >= every visible block, hierarchical selects keys with the
    same scores as flat (the same set up to ties), and the same number of them."""
    L, chunk, top_k, B, qt = 128, 64, 16, 8, 16
    q, w, k = indexer_inputs(3, L, L, 4, 16)
    kern = bench.Kernels("xla")
    flat = bench.make_flat(kern, top_k, chunk)(q, w, k).reshape(L, top_k)
    hier = bench.make_hierarchical(kern, top_k, chunk, B=B, query_tile=qt,
                                   n_cand=L // B)(q, w, k).reshape(L, top_k)
    scores = index_scores_reference(q, w, k)
    np.testing.assert_allclose(_selected_scores(scores, hier),
                               _selected_scores(scores, flat), rtol=1e-6)
    valid = np.asarray((hier >= 0).sum(axis=1))
    np.testing.assert_array_equal(valid, np.minimum(top_k, np.arange(L) + 1))
    assert all(len(set(r[r >= 0])) == len(r[r >= 0]) for r in np.asarray(hier))


def test_pooled_keys_partial_last_block():
    k = jax.random.normal(jax.random.key(0), (10, 4))
    pooled = bench_support.pooled_keys(k, 4)
    np.testing.assert_allclose(pooled[2], k[8:].mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(pooled[0], k[:4].mean(axis=0), rtol=1e-6)
    assert pooled.dtype == jnp.float32
