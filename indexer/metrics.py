"""Selection-quality metrics against a reference selection (DESIGN section 4)."""

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
