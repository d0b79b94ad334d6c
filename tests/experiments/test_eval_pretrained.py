"""The pretrained-model evaluation on a tiny Llama checkpoint: equivalences that must hold
(sparse with top_k >= L is dense) and the passkey probe's construction."""

import json

import numpy as np
import pytest

from experiments.evaluation import pretrained as ev
from experiments.evaluation.passkey import build_passkey_sequence, wilson_interval
from model.pretrained import load_pretrained
from tests.pretrained_files import make_tiny_checkpoints


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_checkpoints(tmp)
    return tmp / "tiny.gguf"


def test_passkey_sequence_holds_each_key_once_before_its_question(tiny):
    tok = load_pretrained(tiny, attention="dense").tokenizer
    filler = np.asarray(tok.encode("plain filler words and more words. " * 80, bos=False))
    seq = build_passkey_sequence(tok, filler, 600, per_sequence=5, seed=1)
    assert len(seq.tokens) == 600 and len(seq.answer_positions) == 5
    text = tok.decode(seq.tokens)
    for positions, digits, depth in zip(seq.answer_positions, seq.answer_tokens, seq.depths):
        assert all(seq.tokens[p + 1] == d for p, d in zip(positions, digits))
        assert positions[0] >= seq.query_start
        key = tok.decode(digits)
        assert text.count(key) == 2  # once in the context, once as the answer
        assert 0.0 < depth < 1.0
    lo, hi = wilson_interval(30, 32)
    assert lo < 30 / 32 < hi and 0 < lo and hi <= 1


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_sparse_with_full_budget_is_dense(tiny, tmp_path):
    L = 256
    ev.main(["--model", str(tiny), "--indexer-dir", "none", "--lengths", str(L),
             "--top-k", str(L), "--hierarchical", "candidate_tokens=256,block_size=16",
             "--queries", "64", "--probe-sequences", "1", "--per-sequence", "3",
             "--out", str(tmp_path)])
    report = json.loads((tmp_path / "eval.json").read_text())
    r = report["lengths"][0]
    dense = r["methods"]["dense"]["perplexity"]
    for method in ("sparse_flat", "sparse_hier"):
        assert r["methods"][method]["perplexity"] == pytest.approx(dense, rel=1e-4)
    assert r["pairs"]["sparse_hier|sparse_flat"]["agreement"] == 1.0
    s = r["selection"]
    assert s["recall_sparse_layers"] == pytest.approx(1.0)
    assert s["mass_flat_sparse_layers"] == pytest.approx(1.0, abs=1e-5)
    assert r["passkey"]["dense"]["probes"] == 3
    assert (tmp_path / "eval.md").read_text().startswith("# ")


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_small_budget_loses_attention_mass(tiny, tmp_path):
    ev.main(["--model", str(tiny), "--indexer-dir", "none", "--lengths", "256",
             "--top-k", "16", "--hierarchical", "candidate_tokens=32,block_size=16",
             "--queries", "64", "--probe-sequences", "0", "--out", str(tmp_path)])
    s = json.loads((tmp_path / "eval.json").read_text())["lengths"][0]["selection"]
    assert 0.0 < s["mass_flat_sparse_layers"] < 1.0
    assert 0.0 < s["recall_sparse_layers"] <= 1.0


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_selection_only(tiny, tmp_path):
    ev.main(["--model", str(tiny), "--indexer-dir", "none", "--lengths", "256",
             "--top-k", "16", "--hierarchical", "candidate_tokens=32,block_size=16",
             "--queries", "32", "--selection-only", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "eval.json").read_text())["lengths"][0]
    assert r["methods"] == {} and 0 < r["selection"]["recall_sparse_layers"] <= 1
    assert "Selection only" in (tmp_path / "eval.md").read_text()
