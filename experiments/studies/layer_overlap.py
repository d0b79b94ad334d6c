"""How much the layers' selections overlap on a real model: what reusing one layer's top-k in
later layers (IndexCache; GLM-5's `shared` layers; SGLang's index_topk_freq) could keep.

    python -m experiments.studies.layer_overlap [--model smollm2-135m] [--indexer-dir DIR]
        [--lengths 8192,16384] [--queries 1024] [--threshold 0.7] [--out DIR]

For each length the model's own prefill, sparse with flat selection as deployed, captures
every layer's selection for the last --queries positions of held-out text. overlap(l, m) =
|S_l & S_m| / top_k, S the tokens a layer keeps for a query, averaged over the queries.
Reported per layer: overlap with the previous layer, and the best earlier layer with its
overlap. Then reuse patterns (ModelConfig.indexer_types: F = the layer runs its indexer,
S = it reuses the nearest earlier F layer's selection): 1/2 of the indexers kept (FSFS...),
1/4 (FSSS...), and the greedy pattern that shares a layer while its overlap with its source
stays >= --threshold. For each, the mean and min over the shared layers of the overlap with
their source: the recall a shared layer's reused selection would have against its own flat
top-k if the reuse upstream left its inputs unchanged (first order: a real reuse pass
changes the hidden states after the first shared layer; the issue's full measurement runs
the pattern itself). Writes OUT/layer_overlap.json and .md (default runs/layer_overlap/).
"""

import argparse
import pathlib
import time

import numpy as np

from experiments.common import (
    add_out_argument,
    display_path,
    enable_compile_cache,
    machine_description,
    recorded_command,
    write_json,
)
from experiments.data import eval_sequence
from experiments.model_source import load_source
from model import ModelRunner


def overlap_matrix(indices, length):
    """indices [layers, Q, top_k] (-1 = none) -> f32[layers, layers]: mean over queries of
    |S_l & S_m| / |S_l|."""
    layers, Q, _ = indices.shape
    total = np.zeros((layers, layers))
    for q in range(Q):
        mask = np.zeros((layers, length), np.float32)
        for layer in range(layers):
            row = indices[layer, q]
            mask[layer, row[row >= 0]] = 1.0
        shared = mask @ mask.T
        total += shared / np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    return total / Q


def sources(pattern):
    """'FSFS...' -> for each layer the layer whose selection it uses."""
    out, source = [], 0
    for layer, kind in enumerate(pattern):
        if kind == "F":
            source = layer
        out.append(source)
    return out


def greedy_pattern(overlap, threshold):
    """Layer 0 full; a layer shares its source's selection while overlap >= threshold."""
    pattern, source = "F", 0
    for layer in range(1, overlap.shape[0]):
        if overlap[layer, source] >= threshold:
            pattern += "S"
        else:
            pattern, source = pattern + "F", layer
    return pattern


def pattern_row(name, pattern, overlap):
    src = sources(pattern)
    shared = [overlap[layer, src[layer]] for layer, kind in enumerate(pattern) if kind == "S"]
    return dict(name=name, pattern=pattern, full=pattern.count("F"),
                shared_overlap_mean=float(np.mean(shared)) if shared else None,
                shared_overlap_min=float(np.min(shared)) if shared else None)


def study_length(model, tokens, queries, threshold):
    L = len(tokens)
    t0 = time.perf_counter()
    _, _, captured = ModelRunner(model).prefill(np.asarray(tokens, np.int32),
                                                capture=("indices",), capture_from=L - queries)
    indices = np.stack([np.asarray(x) for x in captured["indices"]])
    prefill_s = time.perf_counter() - t0
    overlap = overlap_matrix(indices, L)
    n = overlap.shape[0]
    layers = [dict(layer=layer,
                   previous=float(overlap[layer, layer - 1]) if layer else None,
                   best_earlier=int(np.argmax(overlap[layer, :layer])) if layer else None,
                   best_overlap=float(np.max(overlap[layer, :layer])) if layer else None)
              for layer in range(n)]
    patterns = [pattern_row("1/2 kept", "".join("F" if i % 2 == 0 else "S" for i in range(n)),
                            overlap),
                pattern_row("1/4 kept", "".join("F" if i % 4 == 0 else "S" for i in range(n)),
                            overlap),
                pattern_row(f"greedy >= {threshold:g}", greedy_pattern(overlap, threshold),
                            overlap)]
    return dict(length=L, queries=queries, prefill_s=round(prefill_s, 1), layers=layers,
                patterns=patterns, overlap=np.round(overlap, 4).tolist())


def markdown(result):
    lines = [f"Layer overlap of the flat selection: {result['model']} (indexer "
             f"{result['indexer']}), top_k {result['top_k']}, "
             f"last {result['queries']} queries of held-out text. {result['machine']}.", ""]
    for r in result["lengths"]:
        lines += [f"L = {r['length']} (prefill {r['prefill_s']} s):", "",
                  "| layer | overlap with previous | best earlier layer | its overlap |",
                  "|---|---|---|---|"]
        for x in r["layers"][1:]:
            lines.append(f"| {x['layer']} | {x['previous']:.3f} | {x['best_earlier']} | "
                         f"{x['best_overlap']:.3f} |")
        lines += ["", "| pattern | indexers kept | shared layers' overlap with source: mean / "
                  "min |", "|---|---|---|"]
        for p in r["patterns"]:
            mean = "-" if p["shared_overlap_mean"] is None else (
                f"{p['shared_overlap_mean']:.3f} / {p['shared_overlap_min']:.3f}")
            lines.append(f"| {p['name']}: `{p['pattern']}` | {p['full']} | {mean} |")
        lines.append("")
    lines.append(f"Command: `{result['command']}`")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--indexer-dir", default="default",
                   help="trained indexer weights (default: the model's shipped ones), e.g. a "
                        "retrofit stage's")
    p.add_argument("--lengths", default="8192,16384")
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--threshold", type=float, default=0.7)
    add_out_argument(p, "layer_overlap")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < args.queries or args.queries < 1:
        p.error("--lengths must be non-empty and each >= --queries >= 1")
    if not 0 < args.threshold <= 1:
        p.error("--threshold must be in (0, 1]")
    enable_compile_cache()
    t0 = time.monotonic()
    result = dict(command=recorded_command("experiments.studies.layer_overlap", argv),
                  model=args.model, queries=args.queries, machine=machine_description(),
                  lengths=[])
    for L in lengths:  # each length with its own position interpolation, as evaluated
        source = load_source(model_name=args.model, max_length=L, attention="sparse",
                             indexer="flat", indexer_dir=args.indexer_dir)
        result["top_k"] = source.model.config.top_k
        result["indexer"] = display_path(source.directory)
        result["lengths"].append(study_length(source.model, eval_sequence(
            source.heldout_tokens, L), args.queries, args.threshold))
        print(f"L={L} done ({time.monotonic() - t0:.0f} s)", flush=True)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    out = pathlib.Path(args.out)
    write_json(out / "layer_overlap.json", result)
    text = markdown(result)
    (out / "layer_overlap.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
