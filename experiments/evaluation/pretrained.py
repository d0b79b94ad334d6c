"""Fidelity of a pretrained model with its DSA indexer, on held-out real text.

    python -m experiments.evaluation.pretrained --model smollm2-135m --lengths 2048,4096,8192 \
        [--top-k 1024] [--dense-layers 0] [--hierarchical candidate_tokens=4096] \
        [--probe-sequences 4] [--out DIR]

For each length L, on the last L tokens of Python's documentation text (held out from the
warm-up), three passes of model.ModelRunner's prefill: dense, sparse with the flat indexer,
sparse with the hierarchical indexer (all layers sparse except --dense-layers):

- perplexity of each (every position; and positions >= top_k, where selection can differ);
- top-1 agreement and mean KL of next-token distributions: flat | dense, hier | dense,
  hier | flat;
- on the dense pass's own indexer inputs for the last --queries positions (captured from
  that pass): recall and IoU of hierarchical vs flat selections, and attention-mass recall
  (the share of the dense attention, averaged over heads, on the selected tokens) of each,
  per layer and averaged over the sparse layers;
- retrieval probes (experiments.evaluation.retrieval; --probe copy: lists of random words
  asked again at the end, or passkey: five-digit keys), each method on the same
  --probe-sequences sequences x --per-sequence probes: tokens right (interval over
  sequences; sparse methods also as a paired difference to dense) and probes right exactly
  (Wilson 95% interval).

--rope-scaling S (lengths past the model's trained context): linear position interpolation
of the whole model. --selection-only: only the selection statistics (for 16K-32K contexts,
where the three perplexity passes would cost more than they say). --retrieval-only: only the
probes. JSON to OUT/eval.json, a table to OUT/eval.md (default runs/eval_pretrained).
"""

import argparse
import pathlib
import platform
import time

import jax
import numpy as np

from experiments.common import (
    add_out_argument,
    display_path,
    parse_hierarchical,
    parse_layers,
    recorded_command,
    write_json,
)
from experiments.evaluation.baselines import DEFAULT_DIR, baseline_key
from experiments.evaluation.evaluate import target_nll
from experiments.evaluation.metrics import pair_metrics, selection_metrics, selections_on_captured
from experiments.evaluation.pretrained_report import to_markdown
from experiments.evaluation.probe_runs import (
    METHODS,
    check_method,
    method_config,
    retrieval,
    split_method,
)
from experiments.evaluation.retrieval import KINDS, mean_interval
from experiments.text_corpus import heldout_text_tokens
from model import ModelRunner, with_config


def nll_of(logits, tokens):
    """-> (NLL in nats of tokens[1:], log-probs f32[L, V])."""
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return target_nll(lp, tokens)[1:], lp


def attention_mass(selection, target):
    """selection: i32[Q, K] (-1 = none), target: f32[Q, kv] -> mean over queries of the
    target mass on the selected tokens."""
    held = np.take_along_axis(target, np.maximum(selection, 0), axis=1) * (selection >= 0)
    return float(held.sum(axis=1).mean())


def selection_stats(model, tokens, queries, flat_cfg, hier_cfg):
    """The dense pass's own indexer inputs and attention for the last `queries` positions ->
    recall / IoU of hier vs flat and the attention-mass recall of both, per layer."""
    L = len(tokens)
    dense = with_config(model, model.config.replace(attention="dense"))
    _, cache, captured = ModelRunner(dense).prefill(
        tokens, capture=("indexer", "attention_target"), capture_from=L - queries)
    flat = selections_on_captured(flat_cfg, captured, cache, L - queries, L)
    hier = selections_on_captured(hier_cfg, captured, cache, L - queries, L)
    target = captured["attention_target"]
    stats = selection_metrics(flat, hier)
    for i, layer in enumerate(stats["layers"]):
        layer["mass_flat"] = round(attention_mass(flat[i], target[i]), 6)
        layer["mass_hier"] = round(attention_mass(hier[i], target[i]), 6)
        layer["sparse"] = flat_cfg.layer_is_sparse(i)
    sparse = [x for x in stats["layers"] if x["sparse"]] or stats["layers"]
    for key in ("mass_flat", "mass_hier", "recall", "iou"):
        stats[f"{key}_sparse_layers"] = round(float(np.mean([x[key] for x in sparse])), 6)
    stats["mass_ratio"] = round(stats["mass_hier_sparse_layers"] /
                                max(stats["mass_flat_sparse_layers"], 1e-12), 6)
    return stats


def logged_selection_stats(model, tokens, queries, log):
    """selection_stats of the model's flat and hierarchical configs, logged."""
    t = time.monotonic()
    s = selection_stats(model, tokens, queries, method_config(model.config, "sparse_flat"),
                        method_config(model.config, "sparse_hier"))
    log(f"L={len(tokens)} selection: recall {s['recall_sparse_layers']:.4f} iou "
        f"{s['iou_sparse_layers']:.4f} mass flat {s['mass_flat_sparse_layers']:.4f} hier "
        f"{s['mass_hier_sparse_layers']:.4f} ({time.monotonic() - t:.0f} s)")
    return s


def evaluate_length(model, tokenizer, text_tokens, L, *, queries, probe_sequences,
                    per_sequence, seed, log, selection_only=False, probe="copy",
                    retrieval_only=False, methods=METHODS, selection=True, baselines=None,
                    ppl_windows=1):
    tokens = np.asarray(text_tokens[-L:], np.int32)
    cfg = model.config
    out = dict(length=L, methods={})
    if retrieval_only:
        out["retrieval"] = retrieval(model, tokenizer, text_tokens, L, probe, probe_sequences,
                                     per_sequence, seed, log, methods, baselines)
        return out
    if selection_only:
        out["selection"] = logged_selection_stats(model, tokens, min(queries, L), log)
        return out
    windows = [np.asarray(text_tokens[len(text_tokens) - (i + 1) * L:
                                      len(text_tokens) - i * L], np.int32)
               for i in range(ppl_windows)]
    if len(windows[-1]) < L:
        raise ValueError(f"--ppl-windows {ppl_windows} x {L} tokens exceed the held-out text "
                         f"({len(text_tokens)} tokens)")
    runners = {m: ModelRunner(with_config(model, method_config(cfg, m))) for m in methods}
    nlls, walls, window_pairs = {m: [] for m in methods}, dict.fromkeys(methods, 0.0), []
    pairs = [(a, b) for a, b in (("oracle", "dense"), ("sparse_flat", "dense"),
                                 ("sparse_hier", "dense"), ("sparse_hier", "sparse_flat"))
             if a in methods and b in methods]
    reusing = [m for m in methods if split_method(m)[1]]  # each beside dense and its base
    pairs += [(m, ref) for m in reusing for ref in ("dense", split_method(m)[0])
              if ref in methods]
    for window in windows:
        lps = {}
        for method in methods:
            t = time.monotonic()
            logits, _ = runners[method].prefill(window, logits_from=0)
            nll, lps[method] = nll_of(logits, window)
            nlls[method].append(nll)
            walls[method] += time.monotonic() - t
        # KL(P_reference || P_method): the reference is the second of each pair
        window_pairs.append({f"{a}|{b}": pair_metrics(np.asarray(lps[b]), np.asarray(lps[a]))
                             for a, b in pairs})
        del lps
    for method in methods:
        nll = np.stack(nlls[method])  # [windows, L - 1]
        tail = nll[:, cfg.top_k:] if L > cfg.top_k + 1 else nll
        out["methods"][method] = dict(
            perplexity=round(float(np.exp(nll.mean())), 5),
            perplexity_by_window=[round(float(np.exp(w.mean())), 5) for w in nll],
            perplexity_after_top_k=round(float(np.exp(tail.mean())), 5),
            # where in the context the loss is: positions [0, L/4), [L/4, L/2), ...
            perplexity_by_quarter=[round(float(np.exp(q.mean())), 5)
                                   for q in np.array_split(nll, 4, axis=1)],
            windows=len(windows), wall_s=round(walls[method], 1))
        log(f"L={L} {method}: ppl {out['methods'][method]['perplexity']:.4f} over "
            f"{len(windows)} windows ({out['methods'][method]['wall_s']} s)")
    d = out["methods"]["dense"]["perplexity"]
    for method in methods[1:]:
        m = out["methods"][method]
        m["ppl_vs_dense"] = round(m["perplexity"] / d - 1, 6)
        if len(windows) > 1:
            m["ppl_vs_dense_ci95"] = [round(x, 6) for x in window_gap_interval(
                out["methods"]["dense"]["perplexity_by_window"], m["perplexity_by_window"])]
        base = split_method(method)[0]
        if method in reusing and base in methods:
            b = out["methods"][base]
            m["ppl_vs_base"] = round(m["perplexity"] / b["perplexity"] - 1, 6)
            if len(windows) > 1:
                m["ppl_vs_base_ci95"] = [round(x, 6) for x in window_gap_interval(
                    b["perplexity_by_window"], m["perplexity_by_window"])]
    # windows of equal length: the means over positions are means of the windows' means
    out["pairs"] = {k: dict(agreement=round(float(np.mean([w[k]["agreement"]
                                                           for w in window_pairs])), 6),
                            kl_mean=float(np.mean([w[k]["kl_mean"] for w in window_pairs])),
                            kl_max=float(np.max([w[k]["kl_max"] for w in window_pairs])))
                    for k in window_pairs[0]}
    log(f"L={L} pairs: " + ", ".join(f"{k} top1 {v['agreement']:.4f}"
                                     for k, v in out["pairs"].items()))
    if selection:
        out["selection"] = logged_selection_stats(model, tokens, min(queries, L), log)
    if probe_sequences:
        out["retrieval"] = retrieval(model, tokenizer, text_tokens, L, probe, probe_sequences,
                                     per_sequence, seed, log, methods, baselines)
    return out


def window_gap_interval(dense_by_window, method_by_window):
    """The 95% interval of a method's perplexity gap to dense from paired windows: the mean
    over windows of log(ppl_method / ppl_dense), normal interval, mapped back to a ratio - 1
    (windows of equal length, so the mean log ratio is the log of the overall ratio)."""
    _, (lo, hi) = mean_interval(np.log(method_by_window) - np.log(dense_by_window))
    return float(np.expm1(lo)), float(np.expm1(hi))


def _budget_label(h):
    if h.candidate_tokens:
        return h.candidate_tokens
    if h.length_budgets:
        return f"by length {[list(pair) for pair in h.length_budgets]}"
    return f"keep ratio {h.coarse_keep_ratio}"


def main(argv=None):
    from model.pretrained import load_pretrained

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a name or a .gguf / HF folder path")
    p.add_argument("--indexer-dir", default="default",
                   help="trained indexer weights (default: the model's shipped ones)")
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--top-k", type=int, default=None, help="default: the retrofit's own")
    p.add_argument("--dense-layers", default=None, metavar="I,J", help="'' for none")
    p.add_argument("--hierarchical", default=None, metavar="FIELD=VALUE,...",
                   help="HierarchicalConfig overrides, e.g. candidate_tokens=4096")
    p.add_argument("--rope-scaling", type=float, default=None)
    p.add_argument("--index-rope-scaling", type=float, default=None,
                   help="position interpolation of the indexer only (default: rope-scaling)")
    p.add_argument("--queries", type=int, default=1024,
                   help="last positions whose selections are compared")
    p.add_argument("--probe", choices=KINDS + ("needle",), default="copy",
                   help="retrieval probe kind (experiments.evaluation.retrieval; needle: "
                        "experiments.evaluation.needles, --probe-sequences contexts over "
                        "its 5 depths)")
    p.add_argument("--probe-sequences", type=int, default=4)
    p.add_argument("--per-sequence", type=int, default=4,
                   help="probes per sequence (more random-word lists in one context "
                        "confuse SmolLM2-135M even dense: 12 lists in 2K tokens -> 6-12 of "
                        "12 words copied, 4 lists -> all)")
    p.add_argument("--retrieval-only", action="store_true",
                   help="only the retrieval probes (no perplexity or selection passes)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"which passes, dense first ({', '.join(METHODS)}); a sparse method "
                        "with per-layer reuse of selections after '@': sparse_flat@freq2 "
                        "(layers 0, 2, 4, ... run their indexer) or sparse_flat@FSFS... "
                        "(one letter per layer, F runs its indexer, S reuses)")
    p.add_argument("--no-selection", action="store_true",
                   help="skip the selection statistics (the captured dense pass)")
    p.add_argument("--selection-only", action="store_true",
                   help="only the selection statistics (long contexts: no perplexity passes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppl-windows", type=int, default=4,
                   help="consecutive L-token windows from the end of the held-out text whose "
                        "perplexity is measured (the last one also gives the selection "
                        "statistics)")
    p.add_argument("--baselines", default=str(DEFAULT_DIR), metavar="DIR",
                   help="dense / oracle probe scores computed once (experiments.evaluation."
                        "baselines), reused when their seeds, model file and config match; "
                        "'none' to compute them")
    p.add_argument("--write-baselines", action="store_true",
                   help="write the dense / oracle probe scores this run computes to --baselines")
    add_out_argument(p, "eval_pretrained")
    args = p.parse_args(argv)
    methods = tuple(x.strip() for x in args.methods.split(",") if x.strip())
    if not methods or methods[0] != "dense":
        p.error(f"--methods must start with dense, then any of {', '.join(METHODS[1:])}")
    for method in methods:
        try:
            check_method(method)
        except ValueError as e:
            p.error(f"--methods: {e}")
    t0 = time.monotonic()
    overrides = {}
    if args.top_k is not None:
        overrides["top_k"] = args.top_k
    if args.dense_layers is not None:
        overrides["dense_layers"] = parse_layers(args.dense_layers)
    if args.rope_scaling is not None:
        overrides["rope_scaling"] = args.rope_scaling
    if args.index_rope_scaling is not None:
        overrides["index_rope_scaling"] = args.index_rope_scaling
    indexer_dir = None if args.indexer_dir == "none" else args.indexer_dir
    pre = load_pretrained(args.model, indexer_dir=indexer_dir, **overrides)
    model = pre.model
    if args.hierarchical:
        hier = parse_hierarchical(args.hierarchical, model.config.hierarchical)
        model = with_config(model, model.config.replace(hierarchical=hier))
    for method in methods:  # a reuse pattern must fit the model (ModelConfig checks it)
        try:
            method_config(model.config, method)
        except ValueError as e:
            p.error(f"--methods {method}: {e}")
    lengths = [int(x) for x in args.lengths.split(",")]
    top = max(lengths)
    if top > model.config.max_seq_len:
        model = with_config(model, model.config.replace(max_seq_len=top))
    text = heldout_text_tokens(pre.tokenizer)
    log = lambda msg: print(f"[{time.monotonic() - t0:6.0f}s] {msg}", flush=True)  # noqa
    out = pathlib.Path(args.out)
    results = []
    command = recorded_command("experiments.evaluation.pretrained", argv)
    for L in lengths:
        baselines = None if args.baselines == "none" else (
            args.baselines, baseline_key(kind=args.probe, length=L,
                                         per_sequence=args.per_sequence, seed=args.seed,
                                         model_path=pre.info["path"], config=model.config),
            args.write_baselines, command)
        results.append(evaluate_length(model, pre.tokenizer, text, L, queries=args.queries,
                                       probe_sequences=args.probe_sequences,
                                       per_sequence=args.per_sequence, seed=args.seed, log=log,
                                       selection_only=args.selection_only, probe=args.probe,
                                       retrieval_only=args.retrieval_only, methods=methods,
                                       selection=not args.no_selection,
                                       baselines=baselines, ppl_windows=args.ppl_windows))
        report = dict(model=args.model, info=dict(pre.info), config=model.config.to_dict(),
                      hierarchical_budget=_budget_label(model.config.hierarchical),
                      text="last L tokens of pydoc_data.topics (held out from the warm-up)",
                      hardware=f"{platform.machine()}, {jax.devices()[0].device_kind}",
                      command=command, seed=args.seed, lengths=results,
                      wall_s=round(time.monotonic() - t0, 1))
        report["info"]["path"] = pathlib.Path(report["info"]["path"]).name
        if report["info"]["indexer"] != "fresh":
            report["info"]["indexer"] = display_path(report["info"]["indexer"])
        write_json(out / "eval.json", report)
        (out / "eval.md").write_text(to_markdown(report))
    print(to_markdown(report))
    print(f"wrote {display_path(out)}")


if __name__ == "__main__":
    main()
