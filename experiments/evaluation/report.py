"""Markdown report of experiments.evaluation.evaluate's results (results/eval.md)."""


def probe_text(p):
    """One probe result (experiments.evaluation.probe.run_probe) in a table cell or log line."""
    if not p:
        return "n/a"
    return (f"{p['accuracy']:.2f} (gain {p['gain_bits_per_char']:+.2f} bits/char, "
            f"exact {p['exact']:.2f})")


def to_markdown(results):
    lines = ["# dosa long-context evaluation", "",
             f"Model: {results['model']}. Data: {results['data']}. Device: {results['device']}.",
             f"Long-context method: {results.get('long_context', 'n/a')}",
             f"Indexer position interpolation (index_rope_scaling): "
             f"{results.get('config', {}).get('index_rope_scaling')}. Layers kept flat in "
             f"sparse_hier (flat_index_layers): "
             f"{list(results.get('config', {}).get('flat_index_layers') or []) or 'none'}", ""]
    lengths = list(results["lengths"])
    methods = results["methods"]
    has_ref = all("reference" in results["lengths"][L] for L in lengths) and lengths
    ref_head = " | reference: same text in independent training-length windows" if has_ref else ""
    lines += ["## Bits per byte (held-out stdlib text)", "",
              "| tokens | " + " | ".join(methods) + ref_head + " |",
              "|---:|" + "---:|" * (len(methods) + bool(has_ref))]
    for L in lengths:
        r = results["lengths"][L]["methods"]
        ref = (f" | {results['lengths'][L]['reference']['bits_per_byte']:.4f}" if has_ref else "")
        lines.append(f"| {L} | " + " | ".join(f"{r[m]['bits_per_byte']:.4f}" for m in methods)
                     + ref + " |")
    if lengths:
        L = lengths[-1]
        b = results["lengths"][L]["buckets"]
        cols = list(b["bits_per_byte"])
        lines += ["", f"By target position, {L}-token sequence (does bpb grow with distance "
                      "from the start? compare with the reference column):", "",
                  "| positions | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for i, (lo, hi) in enumerate(b["edges"]):
            lines.append(f"| {lo}-{hi} | " + " | ".join(
                f"{b['bits_per_byte'][c][i]:.4f}" if b["bits_per_byte"][c][i] is not None
                else "n/a" for c in cols) + " |")
    lines += ["", "Last quarter of each sequence only:", "",
              "| tokens | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
    for L in lengths:
        r = results["lengths"][L]["methods"]
        lines.append(f"| {L} | " + " | ".join(
            f"{r[m]['bits_per_byte_last_quarter']:.4f}" for m in methods) + " |")
    pairs = sorted({p for L in lengths for p in results["lengths"][L]["pairs"]})
    if pairs:
        lines += ["", "## Agreement of final next-token distributions", "",
                  "| tokens | pair | greedy agreement | mean KL (nats) | max KL |",
                  "|---:|---|---:|---:|---:|"]
        for L in lengths:
            for p, v in results["lengths"][L]["pairs"].items():
                lines.append(f"| {L} | {p.replace('|', ' vs ')} | {v['agreement']:.4f} | "
                             f"{v['kl_mean']:.3e} | {v['kl_max']:.3e} |")
    if any("recall" in results["lengths"][L] for L in lengths):
        lines += ["", "## Hierarchical vs flat selection (model's own indexer inputs)", "",
                  "| tokens | queries | layer | recall | IoU |", "|---:|---:|---:|---:|---:|"]
        for L in lengths:
            rec = results["lengths"][L].get("recall")
            if rec:
                for x in rec["layers"]:
                    lines.append(f"| {L} | {rec['queries']} | {x['layer']} | {x['recall']:.4f} "
                                 f"| {x['iou']:.4f} |")
                lines.append(f"| {L} | {rec['queries']} | mean | {rec['recall_mean']:.4f} | "
                             f"{rec['iou_mean']:.4f} |")
    chance = next((p["chance"] for L in lengths for p in results["lengths"][L]["probe"].values()
                   if p), None)
    lines += ["", "## Retrieval probe", "",
              "`NAME = \"word_word\"` defined near the start, asked for at the end "
              "(experiments/evaluation/probe.py): share of probes whose secret the context lifts "
              f"more than every distractor (chance {chance}); gain = the secret's lift minus the "
              "distractors' in bits per character (lift: bits saved by the context; ~0 when the "
              "definition is not used); exact = greedy continuation equals the secret.",
              "", "| tokens | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
    for L in lengths:
        p = results["lengths"][L]["probe"]
        lines.append(f"| {L} | " + " | ".join(probe_text(p.get(m)) for m in methods) + " |")
    lines += ["", f"Command: `{results['command']}`", ""]
    return "\n".join(lines)
