"""Selection-quality metrics against a reference selection (definitions: docs/design.md,
section 8)."""

import numpy as np


def _row_sets(selected, reference):
    sel = np.asarray(selected)
    ref = np.asarray(reference)
    if sel.shape[0] != ref.shape[0]:
        raise ValueError(f"selected has {sel.shape[0]} rows, reference {ref.shape[0]}")
    for s, r in zip(sel, ref):
        yield set(s[s >= 0].tolist()), set(r[r >= 0].tolist())


def recall(selected, reference):
    """Mean over queries of |selected ∩ reference| / |reference| (-1 ignored; rows with an
    empty reference are skipped). selected: i32[T, K], reference: i32[T, K']."""
    vals = [len(s & r) / len(r) for s, r in _row_sets(selected, reference) if r]
    return float(np.mean(vals)) if vals else 1.0


def iou(selected, reference):
    """Mean over queries of |selected ∩ reference| / |selected ∪ reference| (-1 ignored)."""
    vals = [len(s & r) / len(s | r) for s, r in _row_sets(selected, reference) if s | r]
    return float(np.mean(vals)) if vals else 1.0


def block_recall_ceiling(reference, n_blocks, block_size):
    """The best recall any selection of n_blocks key blocks (of block_size tokens) per query
    can reach against `reference` (i32[T, K], -1 ignored): per query, the reference tokens
    in its n_blocks fullest blocks over all of them, averaged like `recall`. It bounds every
    block-level selector with that budget (the hierarchical indexer with
    candidate_blocks = n_blocks), whatever its coarse scorer."""
    vals = []
    for row in np.asarray(reference):
        row = row[row >= 0]
        if row.size:
            counts = np.sort(np.bincount(row // block_size))[::-1]
            vals.append(counts[:n_blocks].sum() / row.size)
    return float(np.mean(vals)) if vals else 1.0


def topk_block_fraction(reference, block_size, q_positions):
    """Share of (query, visible key block) pairs whose block holds at least one of the
    query's `reference` tokens (i32[T, K], -1 ignored); a block is visible when it starts at
    or before the query's position (q_positions int[T]). Summed over queries before
    dividing, like the exact mode's scored_fraction: exact mode must score every such block,
    so this is the least scored_fraction it can reach, however tight its bounds."""
    holding = visible = 0
    for row, pos in zip(np.asarray(reference), np.asarray(q_positions)):
        holding += np.unique(row[row >= 0] // block_size).size
        visible += int(pos) // block_size + 1
    return holding / max(visible, 1)
