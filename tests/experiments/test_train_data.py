"""experiments.data: the stdlib corpus, its deterministic split, batches."""

import numpy as np
import pytest

from experiments import data
from model.tokenizer import BOS, EOS


def _fake_tree(root):
    files = ["b.py", "a.py", "pkg/__init__.py", "pkg/z.py", "test/test_x.py",
             "site-packages/lib.py", "pkg/tests/t.py", "notes.txt", "__pycache__/a.py"]
    for f in files:
        path = root / f
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {f}\nx = 1\n")
    return root


def test_file_list_is_sorted_deterministic_and_filtered(tmp_path):
    root = _fake_tree(tmp_path)
    files = data.list_source_files(root)
    assert files == ["a.py", "b.py", "pkg/__init__.py", "pkg/z.py"]
    assert files == data.list_source_files(root)


def test_stdlib_file_list_is_sorted_and_stable():
    files = data.list_source_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.endswith(".py") for f in files)
    assert not any(set(f.split("/")[:-1]) & data.EXCLUDED_DIRS for f in files)
    assert files == data.list_source_files()


def test_split_is_disjoint_covering_and_path_determined():
    files = data.list_source_files()
    train, heldout = data.split_files(files, 0.05)
    assert set(train).isdisjoint(heldout) and sorted(train + heldout) == files
    assert 0.01 < len(heldout) / len(files) < 0.12
    # The rule depends on the path alone: any subset splits the same way.
    sub_train, sub_heldout = data.split_files(files[::3], 0.05)
    assert set(sub_heldout) == set(heldout) & set(files[::3])
    assert data.heldout_score("chunk.py") < 0.05 <= data.heldout_score("argparse.py")


def test_token_stream_frames_files_and_batches_replay(tmp_path):
    root = _fake_tree(tmp_path)
    stream = data.encode_files(root, ["a.py", "b.py"])
    text = b"# a.py\nx = 1\n"
    assert stream[0] == BOS and stream[len(text) + 1] == EOS
    assert bytes(stream[1:len(text) + 1].astype(np.uint8)) == text
    tokens = np.arange(1000, dtype=np.uint16)
    a = data.sample_batch(tokens, 3, 16, seed=0, stream=1, step=5)
    b = data.sample_batch(tokens, 3, 16, seed=0, stream=1, step=5)
    c = data.sample_batch(tokens, 3, 16, seed=0, stream=1, step=6)
    assert a.shape == (3, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous windows
    np.testing.assert_array_equal(data.eval_sequence(tokens[:10], 15)[10:], np.arange(5))


def test_corpus_describe_records_split_and_python_version():
    corpus = data.Corpus(max_files=80)
    meta = corpus.describe()
    assert meta["python_version"] and meta["n_files"] == 80
    assert meta["heldout_files"] == corpus.heldout_files
    assert meta["n_train_files"] + meta["n_heldout_files"] == 80
    with pytest.raises(ValueError):
        data.split_files(["a.py"], 1.5)
