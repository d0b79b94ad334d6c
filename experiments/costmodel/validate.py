"""The cost model against measured points (the DeepSeek-V3.2 / GLM-5 projection: dsa.py).

Validation reproduces every committed measurement the model can express, with the same
shapes and the same code path as the run that measured it:
  cpu   results/bench_prefill_small_sparse.json: prefill seconds of the `small` model
        (random weights) per indexer variant, as ModelRunner chunks it;
        results/bench_indexer.json: selection seconds of the last `queries` queries of each
        context (median over its three input kinds: timing does not depend on the inputs);
  h200  results/gpu/pallas_bench_h200.json: whole-sequence index scores, flat and
        hierarchical selection (its pipeline of record: one table of the best coarse blocks
        per query tile), sparse and dense attention. Rows at the file's shortest length are
        the GPU calibration points; the longer ones are out-of-sample.
  cpu   results/frontier/smollm2-135m/frontier.json: flat and hierarchical selection of the
        last `queries` queries over SmolLM2's layers, one row per hierarchical config the
        frontier records (rates measured on the shapes of its model: frontier_model_config).
"""

import json
import pathlib
import statistics

from experiments.common import REPO_ROOT
from experiments.costmodel.rates import gpu_rates, ops_seconds, predict
from indexer import HierarchicalConfig
from indexer.costs import OpList, Selection
from model import ModelConfig
from model.buckets import Chunk
from model.costs import AttentionShape, attention_ops, prefill_counts, selection_ops

PREFILL_JSON = REPO_ROOT / "results" / "bench_prefill_small_sparse.json"
INDEXER_JSON = REPO_ROOT / "results" / "bench_indexer.json"
FRONTIER_JSON = REPO_ROOT / "results" / "frontier" / "smollm2-135m" / "frontier.json"


def _row(where, what, L, predicted, measured, note=""):
    return {"where": where, "what": what, "length": L, "predicted_s": predicted,
            "measured_s": measured, "error": predicted / measured - 1.0, "note": note}


def cpu_prefill_rows(rates, path=PREFILL_JSON):
    """Prefill TTFT of each variant of the committed CPU prefill benchmark."""
    data = json.loads(pathlib.Path(path).read_text())
    rows = []
    for r in data["rows"]:
        L = r["tokens"]
        for name, seconds in r["seconds"].items():
            config = ModelConfig.from_dict(data["variants"][name])
            pred = predict(prefill_counts(config, L, skip=False), rates)
            rows.append(_row("cpu", f"prefill {name}", L, pred["ttft_s"], seconds,
                             f"predicted indexer share {pred['indexer_share']:.0%}"))
    return rows


def cpu_selection_rows(rates, path=INDEXER_JSON):
    """Selection seconds of the committed CPU indexer benchmark (jnp references)."""
    data = json.loads(pathlib.Path(path).read_text())
    s = data["setup"]
    config = HierarchicalConfig.from_dict(s["hierarchical"])
    rows = []
    for r in data["lengths"]:
        L, T = r["length"], r["queries"]
        kinds = [k for k in ("random", "structured", "unaligned") if k in r]
        for kind, key in (("flat", "flat_s"), ("hierarchical", "hierarchical_s")):
            sel = Selection(kind, s["H"], s["d"], s["top_k"], 4, config)
            stages, _ = ops_seconds(OpList(selection_ops(sel, T, L - T, L, skip=False)), rates)
            measured = statistics.median(r[k][key] for k in kinds)
            rows.append(_row("cpu", f"selection {kind}, last {T} queries", L,
                             stages["indexer"], measured, "median of the input kinds"))
    return rows


def frontier_model_config(path=FRONTIER_JSON):
    """The model config of the committed frontier's indexer (its dsa.json), or None when the
    frontier records no per-row hierarchical config (runs before 2026-12-05)."""
    path = pathlib.Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if not any("config" in r for block in data["lengths"] for r in block["rows"]):
        return None
    meta = json.loads((REPO_ROOT / data["indexer"] / "dsa.json").read_text())
    return ModelConfig.from_dict(meta["config"])


def cpu_frontier_rows(rates, config, path=FRONTIER_JSON):
    """Selection seconds of the committed frontier (every layer, the last `queries`
    queries): flat, and each hierarchical row paired with it (its `versus`)."""
    data = json.loads(pathlib.Path(path).read_text())
    T, layers = data["queries"], data["layers"]
    H, d, K = config.index_heads, config.index_dim, data["top_k"]
    rows = []

    def seconds(selection, L):
        ops = OpList(selection_ops(selection, T, L - T, L, skip=False))
        return layers * ops_seconds(ops, rates)[0]["indexer"]

    for block in data["lengths"]:
        L = block["length"]
        flat = f"frontier flat, last {T} queries x {layers} layers"
        rows.append(_row("cpu", flat, L, seconds(Selection("flat", H, d, K, 4), L),
                         block["flat_s"]))
        for r in block["rows"]:
            if "config" not in r or r.get("reuse"):
                continue
            sel = Selection("hierarchical", H, d, K, 4, HierarchicalConfig.from_dict(r["config"]))
            rows.append(_row("cpu", f"frontier hierarchical {r['name']}, last {T} queries x "
                             f"{layers} layers", L, seconds(sel, L), r["hierarchical_s"])
                        | {"versus": flat})
    return rows


def _record_selection(args):
    """The H200 benchmark's selection, as the counts' Selection."""
    budget = args["cand_factor"] * args["top_k"]
    config = HierarchicalConfig(
        block_size=args["block"], candidate_tokens=budget, tile_candidate_tokens=budget,
        share_tile_candidates=True, query_tile=args["query_tile"], fine_batch_size=args["chunk"],
        sink_blocks=1, local_blocks=2, bound_blocks=0, fast_ranking=False)
    return {kind: Selection(kind, args["heads"], args["dim"], args["top_k"], 2, config,
                            tile_candidates=True) for kind in ("flat", "hierarchical")}


def h200_rows(calibration, path):
    """The committed H200 rows, predicted from the H200 rates (calibrated at the shortest
    length, so only those rows are fitted)."""
    data = json.loads(pathlib.Path(path).read_text())
    args = data["args"]
    rates = gpu_rates("h200", "bfloat16", calibration)
    L0 = calibration["calibration_length"]
    sels = _record_selection(args)
    attn = AttentionShape(args["attn_heads"], args["attn_kv_heads"], args["attn_dim"],
                          args["attn_dim"], 2 * args["attn_dim"], 0, "benchmark")
    rows = []
    for L in args["lengths"]:
        chunk = min(args["chunk"], L)
        chunks = [Chunk(c * chunk, c * chunk, chunk, chunk, L) for c in range(L // chunk)]
        pred = {}
        for kind, sel in sels.items():
            ops = OpList()
            for ch in chunks:
                ops.extend(selection_ops(sel, ch.padded, ch.position, ch.kv_len, skip=True))
            pred[kind] = ops_seconds(ops, rates)[0]["indexer"]
            if kind == "flat":
                scores = [op for op in ops if op.name == "flat scores"]
                pred["scores"] = ops_seconds(OpList(scores), rates)[0]["indexer"]
        att = ops_seconds(OpList(attention_ops(attn, L, 0, L, args["top_k"], 2, True)), rates)[0]
        pred["sparse"], pred["dense"] = att["attention"], att["dense_attention"]
        for what, section, start in (("scores", "scores", "pallas index_scores whole"),
                                     ("flat", "select", "flat"),
                                     ("hierarchical", "select", "hierarchical"),
                                     ("sparse", "attention", "sparse_attention"),
                                     ("dense", "attention", "dense causal")):
            m = [r for r in data["results"] if r["section"] == section and r["L"] == L
                 and r["name"].startswith(start) and r.get("time_s")]
            if not m:
                continue
            fitted = L == L0 and what != "hierarchical"
            rows.append(_row("h200", {"scores": "index scores, whole sequence",
                                      "flat": "flat selection", "hierarchical":
                                      "hierarchical selection", "sparse": "sparse attention",
                                      "dense": "dense attention (cuDNN)"}[what], L, pred[what],
                             m[0]["time_s"], "calibration point" if fitted else ""))
    return rows


def summary(rows, min_length=16384):
    """Largest and median |error| over out-of-sample rows at >= min_length tokens."""
    errs = [abs(r["error"]) for r in rows
            if r["length"] >= min_length and r.get("note") != "calibration point"]
    if not errs:
        return {}
    return {"rows": len(errs), "median_abs_error": statistics.median(errs),
            "max_abs_error": max(errs), "within_30_percent": sum(e <= 0.3 for e in errs),
            "min_length": min_length}


def ratio_rows(rows):
    """Flat / hierarchical time ratios of the same setup, predicted vs measured: they do
    not depend on how fast the machine ran when it was calibrated or measured."""
    by_key = {(r["where"], r["what"], r["length"]): r for r in rows}
    out = []
    for (where, what, L), hier in by_key.items():
        if "hierarchical" not in what:
            continue
        flat = by_key.get((where, hier.get("versus") or what.replace(
            "hierarchical:0", "hierarchical").replace("hierarchical", "flat"), L))
        if flat is not None:
            pred = flat["predicted_s"] / hier["predicted_s"]
            meas = flat["measured_s"] / hier["measured_s"]
            label = hier["what"].replace("hierarchical", "flat / hierarchical", 1)
            out.append({"where": where, "what": label,
                        "length": L, "predicted": pred, "measured": meas,
                        "error": pred / meas - 1.0})
    return out
