"""The pretrained-model evaluation on a tiny Llama checkpoint: equivalences that must hold
(sparse with top_k >= L is dense) and the retrieval probes' construction."""

import json

import numpy as np
import pytest

from experiments.evaluation import pretrained as ev
from experiments.evaluation.retrieval import (
    CUE_TOKENS,
    STRING_TOKENS,
    build_probe_sequence,
    mean_interval,
    wilson_interval,
    word_tokens,
)
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
    seq = build_probe_sequence("passkey", tok, filler, 600, per_sequence=5, seed=1)
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
    mean, (lo, hi) = mean_interval([0.5, 0.75, 1.0, 0.75])
    assert mean == 0.75 and lo < 0.75 < hi


def test_copy_sequence_asks_each_string_again_after_its_cue(tiny):
    tok = load_pretrained(tiny, attention="dense").tokenizer
    filler = np.asarray(tok.encode("the quick brown fox jumps over a lazy dog; " * 40 +
                                   "and then some other words follow here. " * 40, bos=False))
    seq = build_probe_sequence("copy", tok, filler, 700, per_sequence=6, seed=3)
    assert len(seq.tokens) == 700 and len(seq.answer_positions) == 6
    toks = seq.tokens.tolist()
    for positions, answer, depth in zip(seq.answer_positions, seq.answer_tokens, seq.depths):
        assert len(positions) == len(answer) == STRING_TOKENS - CUE_TOKENS
        assert positions[0] >= seq.query_start and 0.0 < depth < 1.0
        assert [toks[p + 1] for p in positions] == answer
        cue = toks[positions[0] + 1 - CUE_TOKENS:positions[0] + 1]
        whole = cue + answer
        starts = [i for i in range(len(toks) - STRING_TOKENS + 1)
                  if toks[i:i + STRING_TOKENS] == whole]
        # said once in the body (before the questions), once as the question
        assert len(starts) == 2 and starts[0] < seq.query_start <= starts[1]
    assert word_tokens(tok, filler).size == 0  # bytes: the copy probe used any tokens

    class Words:  # a vocabulary with whole-word tokens
        def decode(self, ids):
            return {1: " river", 2: " Blue", 3: " an", 4: "ing", 5: " stone"}[ids[0]]

    assert word_tokens(Words(), np.array([5, 1, 2, 3, 4, 1])).tolist() == [1, 5]
    with pytest.raises(ValueError, match="probe kind"):
        build_probe_sequence("needle", tok, filler, 700, per_sequence=6, seed=3)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_sparse_with_full_budget_is_dense(tiny, tmp_path):
    L = 256
    ev.main(["--model", str(tiny), "--indexer-dir", "none", "--lengths", str(L),
             "--top-k", str(L), "--hierarchical", "candidate_tokens=256,block_size=16",
             "--queries", "64", "--probe-sequences", "1", "--per-sequence", "3",
             "--methods", "dense,oracle,sparse_flat,sparse_hier", "--ppl-windows", "2",
             "--out", str(tmp_path)])
    report = json.loads((tmp_path / "eval.json").read_text())
    r = report["lengths"][0]
    dense = r["methods"]["dense"]["perplexity"]
    for method in ("oracle", "sparse_flat", "sparse_hier"):
        assert r["methods"][method]["perplexity"] == pytest.approx(dense, rel=1e-4)
        assert len(r["methods"][method]["perplexity_by_window"]) == 2
    assert r["pairs"]["sparse_hier|sparse_flat"]["agreement"] == 1.0
    s = r["selection"]
    assert s["recall_sparse_layers"] == pytest.approx(1.0)
    assert s["mass_flat_sparse_layers"] == pytest.approx(1.0, abs=1e-5)
    assert r["retrieval"]["dense"]["probes"] == 3 and r["retrieval"]["kind"] == "copy"
    assert (tmp_path / "eval.md").read_text().startswith("# ")


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_small_budget_loses_attention_mass(tiny, tmp_path):
    ev.main(["--model", str(tiny), "--indexer-dir", "none", "--lengths", "256",
             "--top-k", "16", "--hierarchical", "candidate_tokens=32,block_size=16",
             "--queries", "64", "--probe-sequences", "0", "--ppl-windows", "1",
             "--out", str(tmp_path)])
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


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_retrieval_only_with_chosen_passes(tiny, tmp_path):
    ev.main(["--model", str(tiny), "--indexer-dir", "none", "--lengths", "256",
             "--top-k", "256", "--retrieval-only", "--methods", "dense,sparse_flat",
             "--probe", "passkey", "--probe-sequences", "2", "--per-sequence", "2",
             "--out", str(tmp_path)])
    r = json.loads((tmp_path / "eval.json").read_text())["lengths"][0]
    pk = r["retrieval"]
    assert r["methods"] == {} and "selection" not in r and pk["kind"] == "passkey"
    assert set(pk) == {"kind", "sequences", "per_sequence", "depths", "dense", "sparse_flat"}
    # top_k = L: sparse attends to every token, so it answers every probe as dense does
    assert pk["sparse_flat"]["scores"] == pk["dense"]["scores"]
    assert pk["sparse_flat"]["token_vs_dense"] == 0.0
    assert all(0.0 <= x <= 1.0 for x in pk["dense"]["scores"])
    assert pk["dense"]["probes"] == 4 and len(pk["depths"]) == 4
    assert "Retrieval probes" in (tmp_path / "eval.md").read_text()
    with pytest.raises(SystemExit):
        ev.main(["--model", str(tiny), "--methods", "sparse_flat", "--out", str(tmp_path)])


def test_copy_rare_strings_never_occur_in_the_filler(tiny):
    tok = load_pretrained(tiny, attention="dense").tokenizer
    filler = np.asarray(tok.encode("the quick brown fox jumps over a lazy dog; " * 40, bos=False))
    seq = build_probe_sequence("copy_rare", tok, filler, 700, per_sequence=4, seed=5)
    assert len(seq.tokens) == 700
    for answer in seq.answer_tokens:
        assert not set(answer) & set(filler.tolist())
    vocab_seq = build_probe_sequence("copy", tok, filler, 700, per_sequence=4, seed=5)
    assert all(set(a) <= set(filler.tolist()) for a in vocab_seq.answer_tokens)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_baselines_are_computed_once_and_reused_only_when_they_match(tiny, tmp_path):
    """The dense and oracle rows written by one run are read by the next (same scores, no
    pass), and not when the seed or the oracle's top_k differs."""
    pre = load_pretrained(tiny, indexer_dir=None, top_k=32)
    text = np.asarray(pre.tokenizer.encode("some words of held-out text, and more. " * 60,
                                           bos=False))
    logs = []
    args = (pre.model, pre.tokenizer, text, 256, "copy", 2, 2)

    def key(seed=0, model=pre.model):
        return ev.baseline_key(kind="copy", length=256, per_sequence=2, seed=seed,
                               model_path=pre.info["path"], config=model.config)

    first = ev.retrieval(*args, 0, logs.append, ("dense", "oracle", "sparse_flat"),
                         (tmp_path, key(), True, "test"))
    assert first["dense"]["source"] == first["oracle"]["source"] == "computed"
    again = ev.retrieval(*args, 0, logs.append, ("dense", "oracle", "sparse_flat"),
                         (tmp_path, key(), False, "test"))
    assert again["dense"]["source"] == again["oracle"]["source"] == "baseline"
    assert again["sparse_flat"]["source"] == "computed"
    for method in ("dense", "oracle", "sparse_flat"):
        assert again[method]["scores"] == first[method]["scores"]
    assert again["oracle"]["token_vs_dense"] == first["oracle"]["token_vs_dense"]
    saved = json.loads((tmp_path / "copy_256.json").read_text())
    assert saved["key"]["model_sha256"] and saved["methods"]["dense"]["sequences"] == 2
    # A longer run computes only the sequences the file lacks, and writes them back.
    args3 = (pre.model, pre.tokenizer, text, 256, "copy", 3, 2)
    longer = ev.retrieval(*args3, 0, logs.append, ("dense",), (tmp_path, key(), True, "t"))
    assert longer["dense"]["source"] == "baseline (2 sequences) + computed"
    fresh = ev.retrieval(*args3, 0, logs.append, ("dense",), None)
    assert longer["dense"]["scores"] == fresh["dense"]["scores"]
    saved = json.loads((tmp_path / "copy_256.json").read_text())
    assert saved["methods"]["dense"]["sequences"] == 3
    assert saved["methods"]["oracle"]["sequences"] == 2  # untouched
    # A pass stopped part way has written the sequences it finished.
    from experiments.evaluation import probe_runs
    calls, score_probes = [], probe_runs.score_probes

    def stop_after_one(*a):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return score_probes(*a)

    stopped = tmp_path / "stopped"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe_runs, "score_probes", stop_after_one)
        with pytest.raises(KeyboardInterrupt):
            ev.retrieval(*args3, 0, logs.append, ("dense",), (stopped, key(), True, "t"))
    saved = json.loads((stopped / "copy_256.json").read_text())
    assert saved["methods"]["dense"]["sequences"] == 1
    assert saved["methods"]["dense"]["scores"] == fresh["dense"]["scores"][:2]
    other = ev.retrieval(*args, 1, logs.append, ("dense",), (tmp_path, key(seed=1), False, ""))
    assert other["dense"]["source"] == "computed" and any("seed 0 != 1" in x for x in logs)
    small = ev.with_config(pre.model, pre.model.config.replace(top_k=16))
    got = ev.retrieval(small, *args[1:], 0, logs.append, ("dense", "oracle"),
                       (tmp_path, key(model=small), False, ""))
    assert got["oracle"]["source"] == "computed" and any("top_k 32 != 16" in x for x in logs)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_needle_context_and_its_questions_from_one_cached_prefix(tiny):
    """The needle sits at its depth, once; each question's teacher-forced score from a copy
    of the context's cache equals the score of one prefill of context + question + answer."""
    from experiments.evaluation.needles import build_needle_context, score_context
    from model import ModelRunner

    pre = load_pretrained(tiny, indexer_dir=None, attention="dense")
    tok = pre.tokenizer
    filler = np.asarray(tok.encode("plain filler words and more words. " * 40, bos=False))
    ctx = build_needle_context(tok, filler, 256, 0.5, seed=2)
    assert len(ctx.tokens) + max(map(len, ctx.questions)) + len(ctx.answer) <= 256
    text = tok.decode(ctx.tokens)
    key = tok.decode(ctx.answer).strip()
    needle = f"\nThe pass key of {text.split('The pass key of ')[1].split()[0]} is {key}.\n"
    before = text.index(needle)  # byte tokens: characters
    assert text.count(key) == 1 and ctx.depth == pytest.approx(0.5, abs=0.01)
    assert before / (len(text) - len(needle)) == pytest.approx(ctx.depth, abs=0.01)
    runner = ModelRunner(pre.model)
    got = score_context(runner, ctx, 256)
    assert len(got) == len(ctx.questions)
    for (teacher, exact), q in zip(got, ctx.questions):
        whole = np.concatenate([ctx.tokens, q, ctx.answer[:-1]]).astype(np.int32)
        logits, _ = runner.prefill(whole, logits_from=len(ctx.tokens) + len(q) - 1)
        want = np.mean(np.asarray(logits).argmax(-1) == np.asarray(ctx.answer))
        assert teacher == pytest.approx(want) and exact in (0.0, 1.0)
    with pytest.raises(ValueError, match="depth"):
        build_needle_context(tok, filler, 256, 1.5, seed=2)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_needle_sweep_runs_from_the_command_line(tiny, tmp_path):
    ev.main(["--model", str(tiny), "--indexer-dir", "none", "--lengths", "256", "--top-k", "32",
             "--retrieval-only", "--probe", "needle", "--probe-sequences", "5",
             "--methods", "dense,oracle,sparse_flat", "--baselines", str(tmp_path / "b"),
             "--write-baselines", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "eval.json").read_text())["lengths"][0]["retrieval"]
    assert r["kind"] == "needle" and r["dense"]["probes"] == 10
    assert len(r["dense"]["by_depth"]) == 5 and "token_vs_dense" in r["oracle"]
    assert (tmp_path / "b" / "needle_256.json").exists()
    report = (tmp_path / "eval.md").read_text()
    assert "oracle" in report and "Needles below dense" in report


def test_contexts_below_dense_pair_each_context_with_its_own():
    from experiments.evaluation.needles import contexts_below

    dense = [[1.0, 1], [0.5, 0], [0.5, 0], [0.5, 0], [1.0, 1], [1.0, 1]]  # 3 contexts x 2
    sparse = [[1.0, 1], [0.4, 0], [0.6, 0], [0.4, 0], [1.0, 1], [1.0, 1]]
    assert contexts_below(sparse, dense, 2) == (1, 3)  # context 0 below; 1 ties at 0.5
    assert contexts_below(dense, dense, 2) == (0, 3)
    with pytest.raises(ValueError, match="contexts_below"):
        contexts_below(sparse[:4], dense, 2)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_quick_proxy_reuses_the_dense_baseline(tiny, tmp_path):
    from experiments.evaluation import proxy

    args = ["--model", str(tiny), "--indexer-dir", "none", "--kl-length", "128",
            "--copy", "256:2", "--baselines", str(tmp_path / "b")]
    proxy.main(args + ["--out", str(tmp_path / "one")])
    proxy.main(args + ["--out", str(tmp_path / "two")])
    one, two = (json.loads((tmp_path / d / "proxy.json").read_text()) for d in ("one", "two"))
    assert one["copy"][0]["dense_source"] == "computed"
    assert two["copy"][0]["dense_source"] == "baseline"
    assert one["copy"][0]["vs_dense"] == two["copy"][0]["vs_dense"]
    assert one["heldout_kl"]["kl"] == two["heldout_kl"]["kl"] > 0
    assert one["indexer"] == "fresh" and one["indexer_sha256"] is None


def test_window_gap_interval_pairs_windows():
    dense = [9.0, 6.0, 7.5, 8.0]
    same_gap = [x * 1.02 for x in dense]  # +2% in every window: no spread
    lo, hi = ev.window_gap_interval(dense, same_gap)
    assert lo == pytest.approx(0.02) and hi == pytest.approx(0.02)
    lo, hi = ev.window_gap_interval(dense, [9.0, 6.0 * 1.04, 7.5, 8.0 * 1.01])
    assert lo < 0.0125 < hi  # the mean log gap sits inside; spread widens it
    lo, hi = ev.window_gap_interval(dense, [9.9, 6.0, 7.5, 8.0])  # one window only
    assert lo < 0 < hi


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_reuse_methods_run_beside_their_base(tiny, tmp_path):
    ev.main(["--model", str(tiny), "--indexer-dir", "none", "--lengths", "256",
             "--top-k", "16", "--no-selection", "--probe-sequences", "1",
             "--per-sequence", "2", "--ppl-windows", "2", "--baselines", "none",
             "--methods", "dense,sparse_flat,sparse_flat@freq1,sparse_flat@FS",
             "--out", str(tmp_path)])
    r = json.loads((tmp_path / "eval.json").read_text())["lengths"][0]
    m = r["methods"]
    # freq1 keeps every indexer: the base itself; FS: layer 1 attends to layer 0's choice
    assert m["sparse_flat@freq1"]["perplexity"] == m["sparse_flat"]["perplexity"]
    assert m["sparse_flat@freq1"]["ppl_vs_base"] == 0.0
    assert m["sparse_flat@FS"]["perplexity"] != m["sparse_flat"]["perplexity"]
    lo, hi = m["sparse_flat@FS"]["ppl_vs_base_ci95"]
    assert lo <= m["sparse_flat@FS"]["ppl_vs_base"] <= hi
    assert r["pairs"]["sparse_flat@freq1|sparse_flat"]["agreement"] == 1.0
    assert {"sparse_flat@FS|dense", "sparse_flat@FS|sparse_flat"} <= set(r["pairs"])
    assert r["retrieval"]["sparse_flat@freq1"]["token_vs_base"] == 0.0
    text = (tmp_path / "eval.md").read_text()
    assert "| 256 | sparse_flat@FS |" in text and "Per-layer reuse" in text
    for bad in ("sparse_flat@FX", "dense@FS", "sparse_flat@FSS", "sparse_flat@"):
        with pytest.raises(SystemExit):
            ev.main(["--model", str(tiny), "--methods", f"dense,{bad}", "--out", str(tmp_path)])
