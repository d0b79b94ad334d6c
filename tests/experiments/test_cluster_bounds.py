"""experiments.studies.cluster_bounds: exact-mode bounds over similarity groups of keys."""

import json

import numpy as np
import pytest

from experiments.studies.cluster_bounds import group_summaries, kmeans, main, study_layer
from indexer.block_summaries import block_summaries


def _clustered(seed, L=512, n_centers=16, d=16, H=2, T=32):
    """Keys in tight clusters, shuffled over positions (every block mixes clusters);
    queries pointing at one cluster each."""
    rng = np.random.default_rng(seed)
    centers = 3.0 * rng.standard_normal((n_centers, d))
    k = centers[rng.integers(0, n_centers, L)] + 0.05 * rng.standard_normal((L, d))
    q = centers[rng.integers(0, n_centers, (T, H))] + 0.1 * rng.standard_normal((T, H, d))
    w = rng.uniform(0.5, 1.5, (T, H))
    w[:, 1] *= -1  # a negative head: the bound must use its lower logit bound
    return q.astype(np.float32), w.astype(np.float32), k.astype(np.float32)


def test_group_summaries_of_contiguous_blocks_equal_block_summaries():
    _, _, k = _clustered(0)
    got = group_summaries(k, np.arange(512) // 64, 8)
    want = block_summaries(k, 64)
    for name in ("sum", "min", "max", "radius"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got.count, want.count)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_similarity_groups_prune_where_position_blocks_cannot():
    q, w, k = _clustered(1)
    rows = study_layer(q, w, k, 16, [16], q_offset=512 - 32, block_size=16)
    blocks, groups = rows["blocks of 16"], rows["k-means 16"]
    for r in rows.values():
        assert r["bound_violations"] == 0  # every group holding a top-k token passes
        assert r["keys_floor"] <= r["keys_rescored"] + 1e-9
    assert blocks["keys_rescored"] > 0.8
    assert groups["keys_rescored"] < 0.4


def test_kmeans_checks_the_cluster_count():
    with pytest.raises(ValueError, match=r"n_clusters must be in \[1, L = 4\]"):
        kmeans(np.ones((4, 2), np.float32), 5)


@pytest.mark.slow
def test_main_on_the_shipped_model(tmp_path, capsys):
    result = main(["--lengths", "1024", "--clusters", "16", "--queries", "32",
                   "--out", str(tmp_path)])
    assert json.loads((tmp_path / "cluster_bounds.json").read_text()) == result
    rows = result["rows"]
    assert [(r["layer"], r["grouping"]) for r in rows[:2]] == [(0, "blocks of 64"),
                                                              (0, "k-means 16")]
    assert len(rows) == 8 and all(r["bound_violations"] == 0 for r in rows)
    assert all(0 < r["keys_floor"] <= r["keys_rescored"] + 1e-9 <= 1 + 1e-9 for r in rows)
    assert "| 1024 | 3 | k-means 16 |" in capsys.readouterr().out
