"""Kernels behind one dispatch point (see api.py)."""

from pallas_kernels.api import (
    BACKENDS,
    gathered_index_scores,
    index_scores,
    map_query_rows,
    resolve_backend,
    rows_within,
    sparse_attention,
)

__all__ = ["BACKENDS", "gathered_index_scores", "index_scores", "map_query_rows",
           "resolve_backend", "rows_within", "sparse_attention"]
