"""The lightning indexer: module, scoring, flat and hierarchical top-k selection, metrics."""

from indexer.block_summaries import BlockSummaryCache, append, block_summaries, empty_summaries
from indexer.coarse_screen import ScreenParams, screen_block_scores, topk_block_shares
from indexer.config import HierarchicalConfig
from indexer.hierarchical import (
    coarse_block_scores,
    fine_topk,
    hierarchical_topk,
    hierarchical_topk_with_stats,
    select_candidate_blocks,
)
from indexer.metrics import block_recall_ceiling, iou, recall, topk_block_fraction
from indexer.module import CoarseScreen, LightningIndexer, ScreenParam
from indexer.scoring import flat_topk, index_scores, topk_indices

__all__ = ["BlockSummaryCache", "CoarseScreen", "HierarchicalConfig", "LightningIndexer",
           "ScreenParam", "ScreenParams", "append", "screen_block_scores", "topk_block_shares",
           "block_recall_ceiling", "block_summaries", "coarse_block_scores", "empty_summaries",
           "fine_topk", "flat_topk",
           "hierarchical_topk", "hierarchical_topk_with_stats", "index_scores", "iou", "recall",
           "select_candidate_blocks", "topk_block_fraction", "topk_indices"]
