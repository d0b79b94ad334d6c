"""The layer-overlap study's arithmetic (experiments.studies.layer_overlap) on hand-made
selections."""

import numpy as np

from experiments.studies.layer_overlap import greedy_pattern, overlap_matrix, pattern_row, sources


def test_overlap_matrix_counts_shared_tokens_per_query():
    # 3 layers, 2 queries, top_k 4; -1 = no token.
    indices = np.array([[[0, 1, 2, 3], [4, 5, 6, 7]],
                        [[0, 1, 8, 9], [4, 5, 6, 7]],
                        [[9, 8, 1, 0], [10, 11, -1, -1]]])
    o = overlap_matrix(indices, 12)
    assert o[1, 0] == (2 / 4 + 4 / 4) / 2
    assert o[2, 1] == (4 / 4 + 0 / 2) / 2  # layer 2's second query keeps 2 tokens
    np.testing.assert_allclose(np.diag(o), 1.0)


def test_patterns_and_their_sources():
    assert sources("FSSFS") == [0, 0, 0, 3, 3]
    overlap = np.array([[1, 0, 0, 0], [0.9, 1, 0, 0], [0.75, 0.8, 1, 0], [0.5, 0.6, 0.9, 1]])
    assert greedy_pattern(overlap, 0.7) == "FSSF"  # layer 3 vs its source 0: 0.5
    row = pattern_row("greedy", "FSSF", overlap)
    assert row["full"] == 2 and row["shared_overlap_mean"] == (0.9 + 0.75) / 2
    assert row["shared_overlap_min"] == 0.75
