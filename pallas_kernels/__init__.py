"""Kernels behind one dispatch point (see api.py)."""

from pallas_kernels.api import (
    OPS,
    gathered_index_scores,
    grouped_matmul,
    index_scores,
    map_query_rows,
    resolve,
    rows_within,
    sparse_attention,
    target_platform,
    use_implementations,
)
from pallas_kernels.grouped_matmul import dequantize_blocks

__all__ = ["OPS", "dequantize_blocks", "gathered_index_scores", "grouped_matmul", "index_scores",
           "map_query_rows", "resolve", "rows_within", "sparse_attention", "target_platform",
           "use_implementations"]
