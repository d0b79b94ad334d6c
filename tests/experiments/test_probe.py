"""The retrieval probe: sequence construction, distractors, and ranking by a scorer."""

import numpy as np
import pytest

from experiments.data import Corpus
from experiments.evaluation.probe import (
    PROBE_NAMES,
    build_sequence,
    candidate_nll,
    distractors,
    run_probe,
)
from model.tokenizer import encode

V = 259


def _corpus():
    return Corpus(heldout_fraction=0.2, max_files=60)


def test_probe_sequence_has_secrets_near_the_start():
    toks, mask, probes = build_sequence(_corpus().heldout_tokens, 1024, seed=0, n_probes=3)
    assert toks.shape == (1024,) and len(probes) == 3
    assert len({s for _, s in probes}) == 3
    text = bytes(t for t in toks[:400] if t < 256).decode("utf-8", "replace")
    for name, secret in probes:
        assert f'{name} = "{secret}"' in text
    assert (~mask).sum() >= sum(len(n) + len(s) + 6 for n, s in probes)


def test_probes_dropped_when_they_do_not_fit():
    toks, _, probes = build_sequence(_corpus().heldout_tokens, 256, seed=0,
                                     n_probes=len(PROBE_NAMES))
    assert toks.shape == (256,) and probes == []


def test_distractors_are_unseen_and_distinct():
    toks, _, probes = build_sequence(_corpus().heldout_tokens, 2048, seed=3, n_probes=4)
    sets = distractors(toks, probes, 5, seed=3)
    text = bytes(t for t in toks if t < 256).decode("utf-8", "replace")
    flat = [d for s in sets for d in s]
    assert [len(s) for s in sets] == [5] * 4 and len(set(flat)) == len(flat)
    assert not any(d in text for d in flat)
    used = {w for _, s in probes for w in s.split("_")}
    assert not {w for d in flat for w in d.split("_")} & used
    for bad in (0, 10_000):
        with pytest.raises(ValueError, match=r"n \(distractors per probe\) must be in"):
            distractors(toks, probes, bad, seed=3)


def _copying_scorer(table):
    """Log-probs that put mass 0.9 on the byte `table` maps the previous two bytes to (a
    stand-in for a model that copies the definition), uniform otherwise."""
    def score(ids):
        lp = np.full((len(ids), V), np.log(0.1 / (V - 1)), np.float32)
        for i in range(len(ids)):
            nxt = table.get(tuple(ids[max(0, i - 1):i + 1]))
            if nxt is None:
                lp[i] = -np.log(V)
            else:
                lp[i, nxt] = np.log(0.9)
        return lp
    return score


def _bigram_table(texts):
    table = {}
    for t in texts:
        ids = encode(t, bos=False)
        for i in range(1, len(ids) - 1):
            table[(int(ids[i - 1]), int(ids[i]))] = int(ids[i + 1])
    return table


def _uniform(ids):
    return np.full((len(ids), V), -np.log(V), np.float32)


def test_copying_scorer_ranks_the_secret_first_and_gains():
    probes = [("SECRET_KEY", "apple_river"), ("API_TOKEN", "tiger_comet")]
    others = [["lemon_walnut", "canyon_pepper"], ["silver_meadow", "forest_stone"]]
    score = _copying_scorer(_bigram_table([f'{n} = "{s}"' for n, s in probes]))
    greedy = lambda prompt, n: encode("x" * n, bos=False)  # noqa: E731
    out = run_probe(score, _uniform, greedy, probes, others)
    assert out["accuracy"] == 1.0 and out["chance"] == round(1 / 3, 4)
    assert out["gain_bits_per_char"] > 2.0 and out["exact"] == 0.0


def test_context_that_changes_nothing_has_no_gain_whatever_the_prior():
    # A prior that strongly prefers the distractor's words; the context adds nothing.
    biased = _copying_scorer(_bigram_table(['SECRET_KEY = "lemon_walnut"']))
    probes = [("SECRET_KEY", "apple_river")]
    for prior in (_uniform, biased):
        out = run_probe(prior, prior, lambda p, n: encode("apple_river", bos=False), probes,
                        [["lemon_walnut"]])
        assert out["accuracy"] == 0.0 and out["exact"] == 1.0
        assert abs(out["gain_bits_per_char"]) < 1e-6
    assert abs(candidate_nll(_uniform, "SECRET_KEY", "apple_river") - np.log2(V)) < 1e-4
