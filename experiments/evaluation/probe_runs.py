"""The retrieval probes run on a pretrained model: the evaluation's methods (dense, the
oracle and the sparse selections, one config each) and `retrieval`, which scores every
method on the same probe sequences (experiments.evaluation.retrieval, .needles), reading
and writing the dense / oracle baselines (experiments.evaluation.baselines)."""

import time

import numpy as np

from experiments.evaluation.baselines import BASELINE_METHODS, load_baseline, save_baseline
from experiments.evaluation.needles import QUESTIONS, needle_contexts, score_context, summarize
from experiments.evaluation.retrieval import (
    build_probe_sequence,
    mean_interval,
    score_probes,
    wilson_interval,
)
from model import ModelRunner, with_config
from model.config import reuse_types

METHODS = ("dense", "oracle", "sparse_flat", "sparse_hier")
# The selection kind each sparse method runs (indexer.selection); "oracle" ranks the layer's
# own dense attention: the limit any indexer can reach.
METHOD_INDEXER = {"oracle": "oracle", "sparse_flat": "flat", "sparse_hier": "hierarchical"}


def split_method(method):
    """"sparse_flat@freq2" -> ("sparse_flat", "freq2"): a sparse method with per-layer reuse
    of selections (ModelConfig.indexer_types) after the "@"; "" when none."""
    base, _, reuse = method.partition("@")
    return base, reuse


def check_method(method):
    """ValueError unless `method` is one of METHODS, or a sparse one with a valid reuse
    spelling after "@"."""
    base, reuse = split_method(method)
    if base not in METHODS or (reuse or "@" in method) and base in ("dense", "oracle"):
        raise ValueError(f"method must be one of {METHODS}, or a sparse one with reuse after "
                         f"'@' (sparse_flat@freq2, sparse_flat@FSFS...), got {method!r}")
    if "@" in method and not reuse:
        raise ValueError(f"method {method!r}: the reuse after '@' is empty")


def method_config(config, method):
    base, reuse = split_method(method)
    if base == "dense":
        return config.replace(attention="dense")
    config = config.replace(attention="sparse", indexer=METHOD_INDEXER[base])
    return config.replace(indexer_types=reuse_types(reuse)) if reuse else config


def retrieval(model, tokenizer, text_tokens, L, kind, n_seq, per_sequence, seed, log,
              methods=METHODS, baselines=None):
    """Retrieval probes (experiments.evaluation.retrieval) of one kind at length L, each
    method scoring the same sequences -> {kind, sequences, per_sequence, depths, method:
    exact accuracy (Wilson interval), token accuracy and, for other methods, its paired
    difference to dense (intervals over sequences), per-probe scores, wall_s, source}.

    baselines: None, or (directory, key, write): dense and oracle scores are read from the
    directory's baseline file when it matches `key` (experiments.evaluation.baselines), and
    written there after computing them when `write`."""
    filler = np.asarray(text_tokens[:-L] if len(text_tokens) > 2 * L else text_tokens)
    if kind == "needle":  # n_seq contexts, each asked len(QUESTIONS) questions
        seqs, per_sequence = needle_contexts(tokenizer, filler, L, n_seq, seed), len(QUESTIONS)
    else:
        seqs = [build_probe_sequence(kind, tokenizer, filler, L, per_sequence=per_sequence,
                                     seed=seed * 1000 + L + i) for i in range(n_seq)]
    result = dict(kind=kind, sequences=n_seq, per_sequence=per_sequence)
    per_seq = {}  # method -> [mean token accuracy of each sequence]
    for method in methods:
        t = time.monotonic()
        stored, have = None, 0
        if baselines is not None and method in BASELINE_METHODS:
            stored, have = load_baseline(baselines[0], baselines[1], method, n_seq, log)
        scores = list(stored or [])
        source = "baseline" if have == n_seq else (
            f"baseline ({have} sequences) + computed" if have else "computed")
        # A baseline pass is written back after every sequence, so a run stopped part way
        # (these passes take hours at 8K on a CPU) leaves a prefix the next run extends.
        keep = baselines is not None and baselines[2] and method in BASELINE_METHODS
        if have < n_seq:
            runner = ModelRunner(with_config(model, method_config(model.config, method)))
            for i, seq in enumerate(seqs[have:], start=have + 1):
                if kind == "needle":
                    scores += score_context(runner, seq, L)
                else:
                    logits, _ = runner.prefill(seq.tokens, logits_from=seq.query_start)
                    scores += score_probes(logits, seq)
                if keep:
                    save_baseline(baselines[0], baselines[1], method, scores, i,
                                  command=baselines[3], wall_s=round(time.monotonic() - t, 1))
        wall = round(time.monotonic() - t, 1)
        # per probe: the share of answer tokens right (teacher forced), and whether the
        # probe was answered exactly (copy / passkey: all tokens right; needle: generated)
        tokens_right = [x[0] for x in scores] if kind == "needle" else scores
        exact = [x[1] == 1.0 for x in scores] if kind == "needle" else \
            [x == 1.0 for x in scores]
        per_seq[method] = [float(np.mean(tokens_right[i * per_sequence:(i + 1) * per_sequence]))
                           for i in range(n_seq)]
        k, n = sum(exact), len(scores)
        lo, hi = wilson_interval(k, n)
        tok, (tlo, thi) = mean_interval(per_seq[method])
        entry = dict(correct=k, probes=n, accuracy=round(k / n, 4),
                     ci95=[round(lo, 4), round(hi, 4)], token_accuracy=round(tok, 4),
                     token_ci95=[round(tlo, 4), round(thi, 4)],
                     scores=np.round(scores, 4).tolist(), wall_s=wall, source=source)
        if kind == "needle":
            entry["by_depth"] = summarize(scores, seqs, per_sequence)["by_depth"]
        line = (f"L={L} {kind} probes {method}: exact {k}/{n} ({k / n:.1%} [{lo:.1%}, "
                f"{hi:.1%}]), tokens {tok:.1%} [{tlo:.1%}, {thi:.1%}]")
        base, reuse = split_method(method)
        for ref, field in (("dense", "token_vs_dense"), (base, "token_vs_base")):
            if method == "dense" or ref not in per_seq or (ref == base and not reuse):
                continue
            diff, (dlo, dhi) = mean_interval(np.subtract(per_seq[method], per_seq[ref]))
            entry[field] = round(diff, 4)
            entry[field + "_ci95"] = [round(dlo, 4), round(dhi, 4)]
            line += f", vs {ref} {diff:+.1%} [{dlo:+.1%}, {dhi:+.1%}]"
        result[method] = entry
        log(line + f" ({source}, {wall} s)")
    result["depths"] = [round(d, 3) for s in seqs for d in
                        ([s.depth] if kind == "needle" else s.depths)]
    return result
