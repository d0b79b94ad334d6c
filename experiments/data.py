"""Training and evaluation text: the running interpreter's standard-library `.py` sources.

Every machine with Python has them, so the corpus needs no download. The file list is the
sorted relative POSIX paths of the `.py` files under `sysconfig.get_paths()["stdlib"]`,
leaving out installed packages (site-packages, dist-packages) and test suites (test, tests,
idle_test), which distributions ship or strip differently. A file is held out when the first
8 bytes of sha256(relative path) read as a fraction fall below `heldout_fraction`: the split
depends on the path alone, so it agrees across machines and Python patch versions.

Token stream: each file is [BOS] + its UTF-8 bytes + [EOS], files concatenated in list order.
"""

import hashlib
import pathlib
import platform
import sysconfig

import numpy as np

from model.cache import layer_of
from model.runner import ModelRunner
from model.tokenizer import BOS, EOS

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                           "idle_test"})
DEFAULT_HELDOUT_FRACTION = 0.05


def stdlib_root():
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root=None):
    """Sorted relative POSIX paths of the `.py` files under root (default: the stdlib)."""
    root = pathlib.Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"source root {root} is not a directory")
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        files.append(rel.as_posix())
    return sorted(files)


def heldout_score(relpath):
    """A deterministic number in [0, 1) from the path alone."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_files(files, heldout_fraction=DEFAULT_HELDOUT_FRACTION):
    """-> (train, heldout), both sorted, disjoint, covering `files`."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    train, heldout = [], []
    for f in sorted(files):
        (heldout if heldout_score(f) < heldout_fraction else train).append(f)
    return train, heldout


def encode_files(root, files):
    """[BOS] + bytes + [EOS] per file, concatenated -> uint16[N]."""
    root = pathlib.Path(root)
    parts = []
    for f in files:
        data = np.frombuffer((root / f).read_bytes(), dtype=np.uint8).astype(np.uint16)
        parts.append(np.concatenate([np.array([BOS], np.uint16), data,
                                     np.array([EOS], np.uint16)]))
    if not parts:
        return np.zeros((0,), np.uint16)
    return np.concatenate(parts)


def file_list_digest(files):
    return hashlib.sha256("\n".join(files).encode("utf-8")).hexdigest()


class Corpus:
    """The file lists and token streams of one split configuration."""

    def __init__(self, root=None, heldout_fraction=DEFAULT_HELDOUT_FRACTION, max_files=None):
        self.root = pathlib.Path(root) if root is not None else stdlib_root()
        self.heldout_fraction = heldout_fraction
        files = list_source_files(self.root)
        if max_files is not None:  # smoke runs: a deterministic prefix of the list
            files = files[:max_files]
        self.files = files
        self.train_files, self.heldout_files = split_files(files, heldout_fraction)
        if not self.train_files or not self.heldout_files:
            raise ValueError(f"corpus split is empty: {len(self.train_files)} train, "
                             f"{len(self.heldout_files)} held-out files under {self.root}")
        self._train = None
        self._heldout = None

    @property
    def train_tokens(self):
        if self._train is None:
            self._train = encode_files(self.root, self.train_files)
        return self._train

    @property
    def heldout_tokens(self):
        if self._heldout is None:
            self._heldout = encode_files(self.root, self.heldout_files)
        return self._heldout

    def describe(self):
        """Metadata written into checkpoints: enough to rebuild and check the split."""
        return dict(
            source="python-stdlib",
            python_version=platform.python_version(),
            python_implementation=platform.python_implementation(),
            excluded_dirs=sorted(EXCLUDED_DIRS),
            heldout_rule="sha256(relative posix path)[:8] as big-endian / 2**64 < fraction",
            heldout_fraction=self.heldout_fraction,
            n_files=len(self.files),
            n_train_files=len(self.train_files),
            n_heldout_files=len(self.heldout_files),
            train_tokens=int(self.train_tokens.shape[0]),
            heldout_tokens=int(self.heldout_tokens.shape[0]),
            file_list_sha256=file_list_digest(self.files),
            heldout_files=list(self.heldout_files),
        )


def sample_batch(tokens, batch_size, seq_len, *, seed, stream, step):
    """Random windows of seq_len + 1 tokens -> int32[batch_size, seq_len + 1].

    A pure function of (seed, stream, step): resuming at a step replays the same batches,
    so the data position is the step count.
    """
    n = int(tokens.shape[0])
    if n < seq_len + 1:
        raise ValueError(f"token stream of {n} tokens is shorter than a window of {seq_len + 1}")
    rng = np.random.default_rng([int(seed), int(stream), int(step)])
    starts = rng.integers(0, n - seq_len, size=batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens[idx], dtype=np.int32)


def eval_sequence(tokens, length, *, offset=0):
    """The first `length` tokens of a held-out stream starting at `offset` (files in list
    order, concatenated) -> int32[length]. Wraps around when the stream is shorter."""
    n = int(tokens.shape[0])
    if n == 0:
        raise ValueError("empty token stream")
    idx = (offset + np.arange(length)) % n
    return np.asarray(tokens[idx], dtype=np.int32)


def model_indexer_inputs(model, tokens, n_queries, *, chunk=None):
    """A model's own indexer inputs on `tokens` (int[L]), captured from its prefill (its
    configured attention, e.g. sparse with flat selection, as deployed) -> list over layers
    of (q f32[Q, H_I, d_I], w f32[Q, H_I], k f32[L, d_I]) numpy arrays for the last
    Q = n_queries positions (query i at position L - Q + i) and every key."""
    tokens = np.asarray(tokens, np.int32)
    L = int(tokens.shape[0])
    if not 1 <= n_queries <= L:
        raise ValueError(f"n_queries must be in [1, len(tokens) = {L}], got {n_queries}")
    _, cache, captured = ModelRunner(model).prefill(tokens, chunk=chunk, capture=("indexer",),
                                                    capture_from=L - n_queries)
    q, w = captured["indexer"].q, captured["indexer"].w
    return [(q[i].astype(np.float32), w[i].astype(np.float32),
             np.asarray(layer_of(cache, model.config, model.config.selection_source(i))
                        .k_index[:L], np.float32))
            for i in range(model.config.n_layers)]
