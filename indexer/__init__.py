"""The lightning indexer: module, scoring, flat and hierarchical top-k selection, metrics.

Names load on first use (PEP 562): `import indexer.config` or `indexer.selection` imports no
JAX, so serving can read its configuration and the selection table before JAX starts.
"""

import importlib

_EXPORTS = {
    # Not `block_summaries`: that name is its submodule (import it from there).
    "indexer.block_summaries": ("BlockSummaryCache", "append", "empty_summaries"),
    "indexer.coarse_screen": ("ScreenParams", "screen_block_scores", "topk_block_shares"),
    "indexer.config": ("HierarchicalConfig",),
    "indexer.hierarchical": ("coarse_block_scores", "fine_topk", "hierarchical_topk",
                             "hierarchical_topk_with_stats", "select_candidate_blocks"),
    "indexer.metrics": ("block_recall_ceiling", "iou", "recall", "topk_block_fraction"),
    "indexer.module": ("CoarseScreen", "LightningIndexer", "ScreenParam"),
    "indexer.scoring": ("flat_topk", "index_scores", "topk_indices"),
    "indexer.selection": ("SELECTIONS", "SelectionKind", "register_selection",
                          "selection_kind", "selection_names"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'indexer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
