"""The teacher cache of the DSA retrofit: what the indexer's loss needs from the frozen model,
computed once per window and trained on for as many epochs as help.

With the base model frozen and every indexer's input detached, layer l's indexer loss
depends only on (a) the hidden states its indexer reads and (b) the layer's dense attention
at the queries the loss averages over. One dense forward of the frozen model per window
captures both (model capture kinds "indexer_input" and "attention_target" at
`capture_rows`); training then never runs the model again. Per 8192-token window of
SmolLM2-135M with 256 query rows: hidden states 30 x 8192 x 576 and target rows
30 x 256 x 8192, both bfloat16, 0.41 GB on disk.

Windows come from the training corpus (experiments.text_corpus, the evaluation text held
out); a share of them has spans repeated at random distances, so that the teacher's
induction heads attend to a copy source far back: the long-range copying the sparse model
loses on the retrieval probes (docs/pretrained.md), rare in ordinary text. A `copy_rows`
share of such a window's rows is drawn inside its intact copies, where that learning is;
the other rows are stratified over the window (one uniform draw per stratum). Rows skip the
first `first_row` positions, where every key fits in top_k and selection cannot differ
from dense.
"""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from experiments.data import sample_batch

TEACHER_CAPTURE = ("attention_target", "indexer_input")
FORMAT = "dosa-teacher-cache-v1"


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """How the retrofit's training windows are drawn (all of it is in the cache's key)."""

    length: int = 8192
    rows: int = 256
    first_row: int = 0
    repeat_share: float = 0.5  # windows with repeated spans
    spans: int = 8  # repeated spans per such window
    span_tokens: tuple[int, int] = (16, 128)  # each span's length, uniform in [lo, hi]
    # Each copy's distance back to its source, uniform in [lo, hi]; None: source and
    # destination uniform in the window, so that copies are mostly near (P(distance >
    # length / 2) ~ 0.15) while the probes' sources at 8K sit 2-6K tokens back.
    copy_distance: tuple[int, int] | None = None
    copy_rows: float = 0.0  # share of a repeat window's rows drawn inside intact copies
    seed: int = 0

    def __post_init__(self):
        where = "WindowPlan"
        if self.length < 2:
            raise ValueError(f"{where}.length must be >= 2, got {self.length}")
        if not 1 <= self.rows <= self.length - self.first_row:
            raise ValueError(f"{where}.rows must be in [1, length - first_row = "
                             f"{self.length - self.first_row}], got {self.rows}")
        if not 0.0 <= self.repeat_share <= 1.0:
            raise ValueError(f"{where}.repeat_share must be in [0, 1], got {self.repeat_share}")
        lo, hi = self.span_tokens
        if not 1 <= lo <= hi or 2 * hi > self.length:
            raise ValueError(f"{where}.span_tokens (lo, hi) must satisfy 1 <= lo <= hi <= "
                             f"length / 2 = {self.length // 2}, got {self.span_tokens}")
        if self.copy_distance is not None:
            d_lo, d_hi = self.copy_distance
            if not hi <= d_lo <= d_hi <= self.length - hi:
                raise ValueError(f"{where}.copy_distance (lo, hi) must satisfy span_tokens' hi "
                                 f"({hi}) <= lo <= hi <= length - {hi} = {self.length - hi}, "
                                 f"got {self.copy_distance}")
        if not 0.0 <= self.copy_rows <= 1.0:
            raise ValueError(f"{where}.copy_rows must be in [0, 1], got {self.copy_rows}")
        if self.spans < 0:
            raise ValueError(f"{where}.spans must be >= 0, got {self.spans}")


def stratified_rows(length, rows, *, seed, first=0):
    """`rows` sorted query positions in [first, length): one uniform draw in each of `rows`
    equal strata -> int32[rows]."""
    edges = np.linspace(first, length, rows + 1)
    rng = np.random.default_rng([int(seed), 7])
    lo, hi = np.ceil(edges[:-1]).astype(np.int64), np.ceil(edges[1:]).astype(np.int64)
    return (lo + np.floor(rng.random(rows) * np.maximum(hi - lo, 1))).astype(np.int32)


def repeat_spans(tokens, rng, *, spans, span_tokens, distance=None):
    """A copy of `tokens` in which `spans` spans reappear later in the window at random
    distances (distance: (lo, hi), each uniform in it; None: source and destination
    uniform) -> (tokens, [(source, destination, length)])."""
    out = np.array(tokens, copy=True)
    T, lo, hi = len(out), span_tokens[0], span_tokens[1]
    placed = []
    for _ in range(spans):
        n = int(rng.integers(lo, hi + 1))
        if distance is None:
            src = int(rng.integers(0, T - 2 * n + 1))
            dst = int(rng.integers(src + n, T - n + 1))
        else:
            gap = int(rng.integers(distance[0], min(distance[1], T - n) + 1))
            src = int(rng.integers(0, T - n - gap + 1))
            dst = src + gap
        out[dst:dst + n] = out[src:src + n]
        placed.append((src, dst, n))
    return out, placed


def copy_positions(tokens, placed):
    """The positions inside a copy (not its first token) whose copy is intact from the
    copy's start to there, after every later span was written -> sorted int array. These
    are the queries whose next token the copy source predicts: the teacher's induction
    heads attend far back there."""
    tokens = np.asarray(tokens)
    out = []
    for src, dst, n in placed:
        intact = np.cumprod(tokens[dst:dst + n] == tokens[src:src + n]).astype(bool)
        out.extend(dst + j for j in range(1, n) if intact[j])
    return np.unique(np.asarray(out, np.int64))


def window_rows(plan, tokens, placed, *, seed, count=None):
    """A window's query rows: a `plan.copy_rows` share drawn uniformly from its intact copies
    (copy_positions, >= first_row; fewer when there are fewer), the rest stratified over
    [first_row, length) -> sorted distinct int32[count or plan.rows]."""
    count = plan.rows if count is None else count
    copies = copy_positions(tokens, placed)
    copies = copies[copies >= plan.first_row]
    n_copy = min(int(round(plan.copy_rows * count)), len(copies))
    rows = stratified_rows(len(tokens), count - n_copy, seed=seed, first=plan.first_row)
    if n_copy:
        rng = np.random.default_rng([int(seed), 11])
        free = np.setdiff1d(copies, rows)
        pick = rng.choice(free, min(n_copy, len(free)), replace=False)
        if len(pick) < n_copy:  # copies the stratified draw took: any other position
            rest = np.setdiff1d(np.arange(plan.first_row, len(tokens)),
                                np.concatenate([rows, pick]))
            pick = np.concatenate([pick, rng.choice(rest, n_copy - len(pick), replace=False)])
        rows = np.sort(np.concatenate([rows, pick]))
    return rows.astype(np.int32)


def training_window(stream, plan, index):
    """Window `index` of the plan (a pure function of plan and index) -> (int32[length],
    {"repeats": [(source, destination, length)]})."""
    tokens = sample_batch(stream, 1, plan.length - 1, seed=plan.seed, stream=23,
                          step=index)[0]
    rng = np.random.default_rng([plan.seed, 29, index])
    if rng.random() >= plan.repeat_share:
        return tokens, dict(repeats=[])
    tokens, placed = repeat_spans(tokens, rng, spans=plan.spans, span_tokens=plan.span_tokens,
                                  distance=plan.copy_distance)
    return tokens, dict(repeats=placed)


def make_teacher(model):
    """-> teacher(tokens int32[T], rows int32[R]) -> dict of numpy arrays: "hidden"
    bf16[n_full, T, d] (what each full layer's indexer reads, in layer order; query_hidden
    too when the model has one), "target" bf16[n_layers, R, T] (every layer's dense
    attention at the rows). One jitted forward of the frozen dense model."""
    if model.config.attention != "dense":
        model = _dense(model)
    graphdef, state = nnx.split(model)
    full = full_layers(model.config)

    @jax.jit
    def run(state, tokens, rows):
        _, captured = nnx.merge(graphdef, state).forward(tokens, capture=TEACHER_CAPTURE,
                                                         capture_rows=rows)
        sources = [captured["indexer_input"][i] for i in full]
        out = dict(hidden=jnp.stack([s.hidden for s in sources]).astype(jnp.bfloat16),
                   target=jnp.stack(captured["attention_target"]).astype(jnp.bfloat16))
        if sources[0].query_hidden is not None:
            out["query_hidden"] = jnp.stack([s.query_hidden for s in sources]
                                            ).astype(jnp.bfloat16)
        return out

    def teacher(tokens, rows):
        got = run(state, jnp.asarray(tokens, jnp.int32), jnp.asarray(rows, jnp.int32))
        return {k: np.asarray(v) for k, v in got.items()}

    return teacher


def full_layers(config):
    """The layers that run an indexer (not "shared" in indexer_types), in order."""
    return [i for i in range(config.n_layers) if not config.layer_is_shared(i)]


def _dense(model):
    from model import with_config

    return with_config(model, model.config.replace(attention="dense"))


class TeacherCache:
    """A folder of teacher windows (window_NNNNN.npz: tokens, rows, hidden, target) and
    key.json (what they depend on: the plan and the base model's file). A key that differs
    empties the folder: a cache is regenerated, never mixed. With shared=True (another
    stage's cache, read by this one) a key that differs is a ValueError instead: that
    stage's windows are not this one's to delete."""

    def __init__(self, directory, key, *, shared=False):
        self.dir = pathlib.Path(directory)
        self.key = json.loads(json.dumps(dict(key, format=FORMAT)))
        self.dir.mkdir(parents=True, exist_ok=True)
        key_file = self.dir / "key.json"
        if key_file.exists() and (old := json.loads(key_file.read_text())) != self.key:
            if shared:
                differ = sorted(k for k in {*old, *self.key} if old.get(k) != self.key.get(k))
                raise ValueError(f"the teacher cache {self.dir} was made with other settings "
                                 f"({', '.join(differ)} differ): it is left as it is")
            for stale in self.dir.glob("*.npz"):
                stale.unlink()
        key_file.write_text(json.dumps(self.key, indent=1))

    def path(self, name):
        return self.dir / f"{name}.npz"

    def has(self, name):
        return self.path(name).exists()

    def write(self, name, tokens, rows, entry, **meta):
        tmp = self.dir / f".{name}.tmp.npz"
        arrays = {k: v.view(np.uint16) for k, v in entry.items()}  # bf16 as its bits
        np.savez(tmp, tokens=np.asarray(tokens, np.int32), rows=np.asarray(rows, np.int32),
                 meta=json.dumps(meta), **arrays)
        tmp.replace(self.path(name))

    def read(self, name):
        """-> dict: tokens, rows, hidden / target (and query_hidden) as bf16 arrays, meta."""
        with np.load(self.path(name)) as f:
            out = {k: f[k] for k in f.files}
        for k in ("hidden", "target", "query_hidden"):
            if k in out:
                out[k] = out[k].view(ml_dtypes.bfloat16)
        out["meta"] = json.loads(str(out["meta"]))
        return out

    def nbytes(self, name):
        return self.path(name).stat().st_size


def fill(cache, teacher, windows, log=print):
    """Computes the teacher for every (name, tokens, rows, meta) not yet in the cache ->
    seconds spent."""
    import time

    spent = 0.0
    for name, tokens, rows, meta in windows:
        if cache.has(name):
            continue
        t = time.monotonic()
        cache.write(name, tokens, rows, teacher(tokens, rows), **meta)
        spent += time.monotonic() - t
        log(f"teacher {name}: {time.monotonic() - t:.0f} s, "
            f"{cache.nbytes(name) / 2**20:.0f} MiB")
    return spent
