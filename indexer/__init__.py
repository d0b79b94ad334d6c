"""The lightning indexer: module, scoring, top-k selection, selection metrics."""

from indexer.metrics import iou, recall
from indexer.module import LightningIndexer
from indexer.scoring import flat_topk, index_scores, topk_indices

__all__ = ["LightningIndexer", "flat_topk", "index_scores", "iou", "recall", "topk_indices"]
