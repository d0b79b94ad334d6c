"""Shadow recall: how closely the deployed selection agrees with flat on live traffic.

For a sample of prefill chunks the engine runs the chunk's step with capture (the model's
own pass also returns every layer's indexer inputs and the indices it attended to:
ModelRunner.prefill(capture=("indexer", "indices"))), then computes the flat selection of
a few sampled query rows of every watched layer from those inputs and the pass's own
indexer-key cache, and compares: recall and IoU (indexer.recall / indexer.iou, DESIGN
section 4) of the deployed selection against flat, per layer, averaged over the rows.
Nothing is recomputed by a copy of the model.

A watched layer is a full layer (it runs its own indexer) whose selection some sparse layer
attends to; a shared layer (indexer_types) attends to its source layer's selection, so it is
counted under that layer. Dense layers select nothing and are not watched.

`ShadowSampler` decides which chunks are watched (host only, no JAX): each chunk with
probability `rate`, while the shadow work of the recent past stays under
`max_seconds_per_s` seconds per second of wall time (a token bucket; a chunk is skipped
while the bucket is in debt). Its rows are `rows` query rows drawn uniformly from the chunk.
"""

import dataclasses
import time

import numpy as np

BURST_S = 10.0  # the bucket holds up to this many seconds' worth of allowance


@dataclasses.dataclass(frozen=True)
class ShadowRecord:
    """One watched chunk: the rows' positions, per watched layer its recall and IoU against
    flat (means over the rows), and the seconds the shadow work took (re-selection, copy,
    metrics; not the capturing step itself, which is the pass)."""

    positions: tuple
    layers: tuple
    recall: tuple
    iou: tuple
    seconds: float

    @property
    def mean_recall(self):
        return float(np.mean(self.recall)) if self.recall else 1.0


class ShadowSampler:
    """Which prefill chunks are watched, and which rows of them."""

    def __init__(self, rate, rows, max_seconds_per_s, *, seed=0, clock=time.monotonic):
        self.rate, self.rows, self.max_seconds_per_s = float(rate), int(rows), max_seconds_per_s
        self._rng = np.random.default_rng(seed)
        self._clock = clock
        self._allowance = BURST_S * max_seconds_per_s
        self._last = clock()
        self.skipped = 0  # chunks drawn but skipped for the budget

    @property
    def enabled(self):
        return self.rate > 0 and self.rows > 0

    def plan(self, start, n):
        """Absolute positions (sorted i32[<= rows]) of the rows to watch in the chunk of n
        tokens at start, or None when this chunk is not watched."""
        if not self.enabled or n < 1:
            return None
        now = self._clock()
        self._allowance = min(BURST_S * self.max_seconds_per_s,
                              self._allowance + (now - self._last) * self.max_seconds_per_s)
        self._last = now
        if self.rate < 1 and self._rng.random() >= self.rate:
            return None
        if self._allowance <= 0:
            self.skipped += 1
            return None
        rows = self._rng.choice(n, size=min(self.rows, n), replace=False)
        return (np.sort(rows) + start).astype(np.int32)

    def charge(self, seconds):
        self._allowance -= seconds


def watched_layers(config):
    """[(layer, user)]: each full layer whose selection a sparse layer attends to, and the
    first sparse layer that does (whose captured indices are that selection)."""
    if config.attention != "sparse":
        return []
    out = []
    for layer in range(config.n_layers):
        if config.layer_is_shared(layer) or not config.layer_needs_selection(layer):
            continue
        user = next(u for u in config.selection_users(layer) if config.layer_is_sparse(u))
        out.append((layer, user))
    return out


def _flat_rows(keys, q, w, positions, *, kv_len, top_k):
    """Flat top_k of R query rows at arbitrary positions, per watched layer.

    keys: tuple of k_index [capacity, d_I] (one per watched layer); q [n, R, H_I, d_I],
    w [n, R, H_I], positions i32[R] -> i32[n, R, top_k]. The flat kind's own math
    (index_scores then topk_indices), with the causal mask of each row's own position."""
    import jax.numpy as jnp

    from indexer.scoring import index_scores, topk_indices

    visible = jnp.arange(kv_len)[None, :] <= positions[:, None]
    out = []
    for i, k in enumerate(keys):
        # q_offset = kv_len: the kernel masks nothing; the rows' own mask is applied here.
        scores = index_scores(q[i], w[i], k[:kv_len], q_offset=kv_len)
        out.append(topk_indices(jnp.where(visible, scores, -jnp.inf), top_k))
    return jnp.stack(out)


def flat_rows_program(out_shardings=None):
    """The jitted _flat_rows (replicated outputs on a mesh: every process reads them)."""
    import jax

    kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
    return jax.jit(_flat_rows, static_argnames=("kv_len", "top_k"),
                   **kwargs)


def compare(layers, deployed, flat):
    """Per watched layer (recall, IoU) of deployed i32[n, R, K] against flat i32[n, R, K]
    with indexer.recall / indexer.iou (means over the rows)."""
    from indexer import iou, recall

    return ([recall(deployed[i], flat[i]) for i in range(len(layers))],
            [iou(deployed[i], flat[i]) for i in range(len(layers))])
