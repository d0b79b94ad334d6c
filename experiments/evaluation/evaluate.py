"""Long-context evaluation of a trained model: dense vs DSA sparse attention.

    python -m experiments.evaluation.evaluate [--checkpoint DIR] [--lengths 8192,16384,32768,65536]
                               [--methods dense,sparse_flat,sparse_hier] [--smoke] [--out DIR]

For each length L, one sequence: held-out standard-library files (the checkpoint's split)
concatenated to L tokens, with a few `NAME = "word_word"` assignments spliced in near the
start.

- bits per byte of each method (dense; sparse with the flat indexer; sparse with the
  hierarchical indexer), over byte targets, the spliced lines
  left out;
- greedy next-token agreement and mean KL(P || Q) of the final next-token distributions for
  each pair (dense | sparse_flat, sparse_flat | sparse_hier, dense | sparse_hier);
- recall and IoU of the hierarchical selection against the flat one, per layer, on the
  model's own indexer inputs (the sparse-flat pass's residual stream) for the last
  --recall-queries query positions;
- retrieval probe (experiments/evaluation/probe.py): after the context (its first L - 64 tokens),
  `\\nNAME = "` is appended; the assigned secret is ranked against unseen distractors
  (teacher forced), with the bits-per-character gain and greedy exact match.

Logits come from model.ModelRunner's chunked prefill over the model's own KV + indexer-key
cache (chunk c reads keys up to a power-of-two bucket of its end), so no [L, L] matrix is
ever built; the flat selection and the indexer inputs are captured from that same pass.
--smoke runs the whole pipeline on a tiny random-initialised model at small lengths.
JSON and Markdown go to OUT/eval.json and OUT/eval.md (default runs/eval/).
"""

import argparse
import json
import math
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import default_out_dir, display_path, parse_hierarchical, parse_layers
from experiments.data import Corpus, file_list_digest
from experiments.evaluation.metrics import (
    pair_metrics,
    selection_metrics,
    selections_on_captured,
)
from experiments.evaluation.probe import (
    PROBE_NAMES,
    PROBE_RESERVE,
    build_sequence,
    distractors,
    run_probe,
)
from experiments.evaluation.report import probe_text, to_markdown
from model import ModelRunner, Transformer, with_config
from model.checkpoint import default_checkpoint_dir, load_default_model
from model.presets import get_config
from model.tokenizer import BOS

METHODS = ("dense", "sparse_flat", "sparse_hier")
PAIRS = (("dense", "sparse_flat"), ("sparse_flat", "sparse_hier"), ("dense", "sparse_hier"))
LN2 = math.log(2.0)


def method_overrides(method):
    return {"dense": dict(attention="dense"),
            "sparse_flat": dict(attention="sparse", indexer="flat"),
            "sparse_hier": dict(attention="sparse", indexer="hierarchical")}[method]


def target_nll(logprobs, tokens):
    """Per-target NLL (nats): out[t] = -log P(tokens[t] | tokens[:t]) for t >= 1; out[0] = nan."""
    out = np.full(len(tokens), np.nan, np.float64)
    out[1:] = -logprobs[np.arange(len(tokens) - 1), tokens[1:]]
    return out


def masked_bpb(nll, mask, lo=0, hi=None):
    """Bits per byte over target positions [lo, hi) where mask holds and nll is defined."""
    sel = np.zeros(len(nll), bool)
    sel[lo:hi] = True
    sel &= mask & np.isfinite(nll)
    if not sel.any():
        return None, 0
    return float(nll[sel].mean() / LN2), int(sel.sum())


def _round(x, n=5):
    return None if x is None else round(x, n)


def position_buckets(length, first):
    """[(lo, hi)]: [0, first), [first, 2 first), [2 first, 4 first) ... up to length."""
    edges = [0]
    edge = first
    while edge < length:
        edges.append(edge)
        edge *= 2
    edges.append(length)
    return list(zip(edges[:-1], edges[1:]))


def window_reference_nll(model, tokens, window):
    """Per-target NLL of the same tokens read in independent dense windows of `window`
    tokens (the training length), each from scratch: the in-distribution reference a long
    context should match or beat. nan at each window's first token."""
    cfg = model.config.replace(attention="dense", rope_scaling=1.0)
    dense = with_config(model, cfg)
    graphdef, state = nnx.split(dense)

    @jax.jit
    def forward(state, toks):
        return jax.nn.log_softmax(nnx.merge(graphdef, state).forward(toks), axis=-1)

    out = np.full(len(tokens), np.nan, np.float64)
    for lo in range(0, len(tokens), window):
        piece = tokens[lo:lo + window]
        if len(piece) < 2:
            break
        if len(piece) < window:  # pad the last window; padded positions are never read
            piece = np.concatenate([piece, np.zeros(window - len(piece), np.int32)])
        lp = np.asarray(forward(state, jnp.asarray(piece)))
        n = min(window, len(tokens) - lo)
        out[lo:lo + n] = target_nll(lp[:n], tokens[lo:lo + n])
    return out


def log_probs(runner, tokens, *, chunk, cache=None, start=0, capture=(), capture_from=None):
    """Log-probabilities f32[N, V] (numpy) of every position of `tokens` read at `start`
    through runner.prefill -> (log-probs, cache[, captured])."""
    out = runner.prefill(tokens, cache=cache, start=start, chunk=chunk, logits_from=start,
                         capture=capture, capture_from=capture_from)
    return (np.asarray(jax.nn.log_softmax(out[0], axis=-1)),) + tuple(out[1:])


def full_pass(runner, tokens, split, *, chunk, recall_from=None, other_config=None):
    """Log-probs of the whole sequence, read in two calls so that the cache can be copied at
    `split` (the end of the probe's context): appending the probe over a cache that already
    holds later tokens would count them twice in the block summaries.

    recall_from: capture the pass's own selections (and indexer inputs) for the queries at
    positions >= recall_from, and run `other_config`'s selection on the same inputs.
    -> (log-probs f32[L, V], (own, other) i32[n_layers, Q, top_k] or None, cache copy at split).
    """
    cache = runner.new_cache(len(tokens))
    capture = ("indexer", "indices") if recall_from is not None else ()
    parts, captured = [], []
    for lo, hi in ((0, split), (split, len(tokens))):
        kinds = capture if capture and hi > recall_from else ()
        out = log_probs(runner, tokens[lo:hi], chunk=chunk, cache=cache, start=lo,
                        capture=kinds, capture_from=max(lo, recall_from or 0) if kinds else None)
        parts.append(out[0])
        cache = out[1]
        if kinds:
            captured.append(out[2])
        if lo == 0:
            snapshot = jax.tree.map(jnp.copy, cache)
    selections = None
    if captured:
        captured = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *captured)
        other = selections_on_captured(other_config, captured, cache, recall_from, len(tokens))
        selections = (captured["indices"], other)
    return np.concatenate(parts), selections, snapshot


def probe_method(runner, cache, start, probes, distractor_sets, *, chunk):
    """experiments.evaluation.probe.run_probe over a copy of `cache` per candidate (read from
    `start`), against the same candidates read with no context."""
    def score(ids):
        return log_probs(runner, ids, chunk=chunk, cache=jax.tree.map(jnp.copy, cache),
                         start=start)[0]

    def prior(ids):  # after BOS, as every sequence starts
        return log_probs(runner, np.concatenate([[BOS], ids]), chunk=chunk)[0][1:]

    def greedy(prompt, n):
        return list(runner.generate(prompt, n, cache=jax.tree.map(jnp.copy, cache),
                                    start=start))

    return run_probe(score, prior, greedy, probes, distractor_sets)


# ------------------------------------------------------------------ the evaluation

def evaluate(model, heldout_tokens, lengths, *, methods=METHODS, chunk=None, seed=0,
             n_probes=len(PROBE_NAMES), n_distractors=7, recall_queries=1024,
             rope_scaling=None, train_len=None, reference_window=None, log=print):
    """-> results dict (see module docstring)."""
    base_config = model.config
    chunk = chunk or base_config.prefill_chunk
    active = list(methods)
    results = {"lengths": {}, "methods": active}
    for length in lengths:
        if length > base_config.max_seq_len:
            raise ValueError(f"length {length} > max_seq_len {base_config.max_seq_len}")
        scaling = base_config.rope_scaling
        if rope_scaling == "auto":
            scaling = max(1.0, length / float(train_len))
        elif rope_scaling is not None:
            scaling = float(rope_scaling)
        tokens, mask, probes = build_sequence(heldout_tokens, length, seed=seed,
                                              n_probes=n_probes)
        probe_distractors = distractors(tokens, probes, n_distractors, seed=seed)
        ctx_end = length - PROBE_RESERVE
        row = {"tokens": length, "rope_scaling": scaling, "methods": {}, "pairs": {},
               "probe": {}}
        logprobs = {}
        buckets = position_buckets(length, min(train_len or 2048, length))
        row["buckets"] = {"edges": [list(b) for b in buckets], "bits_per_byte": {}}
        if reference_window:
            t0 = time.perf_counter()
            ref = window_reference_nll(model, tokens, reference_window)
            bpb, count = masked_bpb(ref, mask)
            row["reference"] = {"window": reference_window, "bits_per_byte": _round(bpb),
                                "targets": count, "wall_s": round(time.perf_counter() - t0, 2)}
            row["buckets"]["bits_per_byte"]["reference"] = [
                _round(masked_bpb(ref, mask, lo, hi)[0]) for lo, hi in buckets]
            log(f"L={length} reference ({reference_window}-token windows): bpb {bpb:.4f}")
        for method in active:
            cfg = base_config.replace(rope_scaling=scaling, **method_overrides(method))
            recall_cfg = None
            if method == "sparse_flat" and "sparse_hier" in active and recall_queries > 0:
                recall_cfg = cfg.replace(indexer="hierarchical")
            runner = ModelRunner(with_config(model, cfg))
            t0 = time.perf_counter()
            recall_from = max(0, length - recall_queries) if recall_cfg is not None else None
            lp, sel, probe_cache = full_pass(runner, tokens, ctx_end, chunk=chunk,
                                             recall_from=recall_from, other_config=recall_cfg)
            wall = time.perf_counter() - t0
            nll = target_nll(lp, tokens)
            bpb, count = masked_bpb(nll, mask)
            row["methods"][method] = {"bits_per_byte": _round(bpb), "targets": count,
                                      "wall_s": round(wall, 2)}
            # Tail: the last quarter of the sequence (the farthest from position 0).
            row["methods"][method]["bits_per_byte_last_quarter"] = _round(
                masked_bpb(nll, mask, length * 3 // 4)[0])
            row["buckets"]["bits_per_byte"][method] = [
                _round(masked_bpb(nll, mask, lo, hi)[0]) for lo, hi in buckets]
            if sel is not None:
                row["recall"] = selection_metrics(*sel)
            logprobs[method] = lp
            if probes:
                row["probe"][method] = probe_method(runner, probe_cache, ctx_end, probes,
                                                    probe_distractors, chunk=chunk)
            del probe_cache
            log(f"L={length} {method}: bpb {row['methods'][method]['bits_per_byte']:.4f} "
                f"(last quarter {row['methods'][method]['bits_per_byte_last_quarter']:.4f}), "
                f"probe {probe_text(row['probe'].get(method))} "
                f"[{wall:.1f}s]" + (f", recall {row['recall']['recall_mean']:.4f} IoU "
                                    f"{row['recall']['iou_mean']:.4f}" if sel is not None else ""))
        for a, b in PAIRS:
            if a in logprobs and b in logprobs:
                row["pairs"][f"{a}|{b}"] = pair_metrics(logprobs[a], logprobs[b])
        results["lengths"][str(length)] = row
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint directory (default: $DOSA_CHECKPOINT or checkpoints/small)")
    p.add_argument("--lengths", default=None,
                   help="comma-separated token counts (default 8192,16384,32768,65536; "
                        "smoke: 256,512)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--smoke", action="store_true",
                   help="tiny random-initialised model, small lengths: tests the pipeline")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: config)")
    p.add_argument("--probes", type=int, default=len(PROBE_NAMES),
                   help=f"secrets per sequence, 0..{len(PROBE_NAMES)}")
    p.add_argument("--distractors", type=int, default=7,
                   help="unseen candidate secrets each secret is ranked against (>= 1)")
    p.add_argument("--recall-queries", type=int, default=1024,
                   help="last query positions on which hierarchical-vs-flat recall is measured")
    p.add_argument("--rope-scaling", default=None,
                   help="override rope_scaling: a number, or 'auto' = length / train length "
                        "(linear position interpolation); default: the checkpoint's")
    p.add_argument("--index-rope-scaling", default=None, metavar="S",
                   help="override index_rope_scaling (the indexer's own position "
                        "interpolation factor), a number or 'none' (= rope_scaling)")
    p.add_argument("--top-k", type=int, default=None, help="override top_k")
    p.add_argument("--hierarchical", default=None, metavar="FIELD=VALUE,...",
                   help="override HierarchicalConfig fields, e.g. "
                        "'candidate_tokens=2816,local_blocks=4'")
    p.add_argument("--flat-index-layers", default=None, metavar="I,J,...",
                   help="layers whose selection stays flat in the hierarchical method "
                        "(ModelConfig.flat_index_layers), e.g. '0'; 'none' for none")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the independent-window reference (same text, training length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="output folder (default runs/eval/; results of record: results/)")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = sorted(set(methods) - set(METHODS))
    if bad:
        p.error(f"unknown methods {bad}; choose from {METHODS}")
    if not 0 <= args.probes <= len(PROBE_NAMES):
        p.error(f"--probes must be in [0, {len(PROBE_NAMES)}], got {args.probes}")
    if args.distractors < 1:
        p.error(f"--distractors must be >= 1, got {args.distractors}")
    lengths_text = args.lengths or ("256,512" if args.smoke else "8192,16384,32768,65536")
    lengths = [int(x) for x in lengths_text.split(",") if x.strip()]
    if any(L < 2 * PROBE_RESERVE for L in lengths):
        p.error(f"lengths must be >= {2 * PROBE_RESERVE}")

    if args.smoke:
        print("SMOKE RUN: the tiny preset with random weights at small lengths; it checks the "
              "pipeline, its figures say nothing about any trained model")
        config = get_config("tiny", max_seq_len=max(4096, max(lengths)))
        model = Transformer(config, rngs=nnx.Rngs(args.seed))
        corpus = Corpus(heldout_fraction=0.2, max_files=60)
        model_desc = "tiny preset, random initialisation (--smoke)"
        long_context = "n/a (smoke)"
        train_len = 64
    else:
        directory = pathlib.Path(args.checkpoint) if args.checkpoint else default_checkpoint_dir()
        overrides = dict(max_seq_len=max(max(lengths), 1))
        if args.top_k:
            overrides["top_k"] = args.top_k
        model, metadata = load_default_model(directory, **overrides)
        data = metadata.get("data", {})
        corpus = Corpus(heldout_fraction=float(data.get("heldout_fraction", 0.05)))
        if data.get("file_list_sha256") and data["file_list_sha256"] != file_list_digest(
                corpus.files):
            print(f"note: this Python's stdlib file list differs from the training machine's "
                  f"(trained on Python {data.get('python_version')}, here "
                  f"{platform.python_version()}); the held-out rule is per path, so held-out "
                  "files are still unseen")
        config = model.config
        model_desc = (f"{display_path(directory)} (step metadata: "
                      f"{metadata.get('training', {}).get('total_steps')} steps)")
        lc = metadata.get("long_context", {})
        long_context = lc.get("note", "n/a")
        train_len = int(metadata.get("seq_len", 2048))
    if args.top_k and args.smoke:
        model = with_config(model, model.config.replace(top_k=args.top_k))
    if args.hierarchical:
        hier = parse_hierarchical(args.hierarchical, model.config.hierarchical)
        model = with_config(model, model.config.replace(hierarchical=hier))
    if args.index_rope_scaling is not None:
        value = args.index_rope_scaling.strip().lower()
        model = with_config(model, model.config.replace(
            index_rope_scaling=None if value == "none" else float(value)))
    if args.flat_index_layers is not None:
        try:
            model = with_config(model, model.config.replace(
                flat_index_layers=parse_layers(args.flat_index_layers)))
        except ValueError as e:
            p.error(f"--flat-index-layers {args.flat_index_layers!r}: {e}")
    t0 = time.perf_counter()
    results = evaluate(model, corpus.heldout_tokens, lengths, methods=methods, chunk=args.chunk,
                       seed=args.seed, n_probes=args.probes,
                       n_distractors=args.distractors, recall_queries=args.recall_queries,
                       rope_scaling=args.rope_scaling, train_len=train_len,
                       reference_window=None if args.no_reference else train_len)
    d = jax.devices()[0]
    results.update(model=model_desc, config=model.config.to_dict(), long_context=long_context,
                   data=f"{len(corpus.heldout_files)} held-out stdlib files (Python "
                        f"{platform.python_version()})",
                   device=f"{d.platform}:{d.device_kind}", jax_version=jax.__version__,
                   wall_s=round(time.perf_counter() - t0, 1),
                   command="python -m experiments.evaluation.evaluate "
                   + " ".join(argv if argv is not None
                                                                   else sys.argv[1:]))
    out = pathlib.Path(args.out) if args.out else default_out_dir("eval")
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(results, indent=1))
    (out / "eval.md").write_text(to_markdown(results))
    print(f"wrote {out / 'eval.json'} and {out / 'eval.md'} ({results['wall_s']}s)")
    return results


if __name__ == "__main__":
    main()
