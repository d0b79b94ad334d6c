"""Real text for pretrained models: documents that ship with Python and Debian, tokenized
with the model's own tokenizer.

Documents: the standard library's `.py` sources (experiments.data's file list: no tests,
no site-packages) and English documentation under /usr/share (common-licenses, and the
README / .txt / .md files of /usr/share/doc, gzipped or not). A document is held out when
sha256(its name)[:8] / 2**64 < heldout_fraction; Python's own documentation text
(`pydoc_data.topics`, HELDOUT_TEXT) is always held out: it is the evaluation text.
Token stream: each document's tokens followed by EOS, documents in name order.
"""

import gzip
import hashlib
import pathlib

import numpy as np

from experiments.data import heldout_score, list_source_files, stdlib_root

DOC_ROOTS = (pathlib.Path("/usr/share/common-licenses"), pathlib.Path("/usr/share/doc"))
DOC_PATTERNS = ("README*", "*.txt", "*.md", "*.txt.gz", "*.md.gz")
HELDOUT_TEXT = "pydoc_data/topics"
MAX_DOC_BYTES = 1 << 20


def pydoc_topics_text():
    """Python's documentation topics, joined in key order (the held-out evaluation text)."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def _read(path):
    data = path.read_bytes()[:MAX_DOC_BYTES * 4]
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return ""
    return data[:MAX_DOC_BYTES].decode("utf-8", errors="replace")


def list_documents():
    """Sorted names of the corpus's documents ("stdlib/<relpath>" or "doc/<path from />")."""
    # pydoc_data/topics.py holds the evaluation text itself: never a training document
    names = [f"stdlib/{f}" for f in list_source_files() if not f.startswith("pydoc_data/")]
    for root in DOC_ROOTS:
        if not root.is_dir():
            continue
        seen = set()
        for pattern in ("*", *(f"*/{p}" for p in DOC_PATTERNS)) if root.name != "doc" else \
                (f"*/{p}" for p in DOC_PATTERNS):
            for path in root.glob(pattern):
                if path.is_file() and not path.is_symlink() and path not in seen:
                    seen.add(path)
                    names.append("doc/" + path.as_posix().lstrip("/"))
    return sorted(names)


def read_document(name):
    if name.startswith("stdlib/"):
        return (stdlib_root() / name[len("stdlib/"):]).read_text("utf-8", errors="replace")
    if name.startswith("doc/"):
        return _read(pathlib.Path("/" + name[len("doc/"):]))
    raise ValueError(f"unknown document {name!r}")


def split_documents(names, heldout_fraction=0.05):
    """-> (train, heldout) names, both sorted: held out when the name's hash says so."""
    names = sorted(names)
    train = [n for n in names if heldout_score(n) >= heldout_fraction]
    heldout = [n for n in names if heldout_score(n) < heldout_fraction]
    return train, heldout


def token_stream(tokenizer, names, *, cache=None):
    """Each document's tokens + EOS, concatenated -> int32[N]; cached as .npy under `cache`
    (keyed by the names and the tokenizer's vocabulary size) when given."""
    key = hashlib.sha256(("\n".join(names) + f"|{tokenizer.vocab_size}").encode()).hexdigest()
    path = pathlib.Path(cache) / f"tokens-{key[:16]}.npy" if cache is not None else None
    if path is not None and path.is_file():
        return np.load(path)
    parts = []
    for name in names:
        text = read_document(name)
        if text.strip():
            parts.append(np.asarray(tokenizer.encode(text, bos=False, eos=True), np.int32))
    stream = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, stream)
    return stream


def heldout_text_tokens(tokenizer):
    """The evaluation text (pydoc topics) as int32 tokens, no BOS (as the issue's checks)."""
    return np.asarray(tokenizer.encode(pydoc_topics_text(), bos=False), np.int32)
