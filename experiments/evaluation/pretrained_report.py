"""eval.md of `experiments.evaluation.pretrained`: the main table per length, the reuse
table, selection-only rows, retrieval probes and needles by depth, from its report dict."""

from experiments.evaluation.needles import contexts_below
from experiments.evaluation.probe_runs import METHODS, split_method


def _probe_cell(e):
    cell = f"tokens {e['token_accuracy']:.1%} [{e['token_ci95'][0]:.1%}, {e['token_ci95'][1]:.1%}]"
    for field, ref in (("token_vs_dense", ""), ("token_vs_base", " vs its base")):
        if field in e:
            lo, hi = e[field + "_ci95"]
            cell += f" ({e[field]:+.1%} [{lo:+.1%}, {hi:+.1%}]{ref})"
    return cell + (f"; exact {e['correct']}/{e['probes']} = {e['accuracy']:.1%} "
                   f"[{e['ci95'][0]:.1%}, {e['ci95'][1]:.1%}]")


def _gap(value, ci):
    return f"{value:+.2%}" + (f" [{ci[0]:+.2%}, {ci[1]:+.2%}]" if ci else "")


def _reuse_rows(r):
    """Rows of the reuse table for one length: each method with per-layer reuse beside dense
    and the same method without it (its base)."""
    m, pairs = r["methods"], r["pairs"]
    rows = []
    for method in (x for x in m if split_method(x)[1]):
        e, base = m[method], split_method(method)[0]
        vs_base = _gap(e["ppl_vs_base"], e.get("ppl_vs_base_ci95")) if "ppl_vs_base" in e \
            else "-"
        agree = [f"{pairs[k]['agreement']:.4f}" if k in pairs else "-"
                 for k in (f"{method}|dense", f"{method}|{base}")]
        rows.append(f"| {r['length']} | {method} | {e['perplexity']:.3f} | "
                    f"{_gap(e['ppl_vs_dense'], e.get('ppl_vs_dense_ci95'))} | {vs_base} | "
                    + " | ".join(agree) + " |")
    return rows


def _table_row(r):
    """One length's row of the main table; "-" where a pass or statistic was not run."""
    m, pairs, s = r["methods"], r["pairs"], r.get("selection", {})
    pk = r.get("retrieval", r.get("passkey", {}))

    def ppl(method):
        if method not in m:
            return "-"
        gap, ci = m[method].get("ppl_vs_dense"), m[method].get("ppl_vs_dense_ci95")
        cell = f"{m[method]['perplexity']:.3f}"
        return cell + (f" ({_gap(gap, ci)})" if gap is not None else "")

    def agree(pair):
        return f"{pairs[pair]['agreement']:.4f}" if pair in pairs else "-"

    def sel(key):
        return f"{s[key]:.4f}" if key in s else "-"

    def probes(method):
        return f"{pk[method]['correct']}/{pk[method]['probes']}" if method in pk else "-"

    return " | ".join([
        f"| {r['length']}", ppl("dense"), ppl("oracle"), ppl("sparse_flat"), ppl("sparse_hier"),
        agree("sparse_flat|dense"), agree("sparse_hier|dense"), agree("sparse_hier|sparse_flat"),
        sel("recall_sparse_layers"), sel("iou_sparse_layers"), sel("mass_flat_sparse_layers"),
        sel("mass_hier_sparse_layers"), probes("dense"), probes("sparse_flat"),
        probes("sparse_hier")]) + " |"


def to_markdown(report):
    lines = [f"# {report['model']}: dense vs DSA on held-out text", "",
             f"top_k {report['config']['top_k']}, dense layers "
             f"{report['config']['dense_layers'] or 'none'}, hierarchical "
             f"{report['hierarchical_budget']}, rope_scaling {report['config']['rope_scaling']}, "
             f"index_rope_scaling {report['config']['index_rope_scaling']}"]
    selection_only = [r for r in report["lengths"] if not r["methods"] and "selection" in r]
    probed = [r for r in report["lengths"] if "retrieval" in r]
    passes = [r for r in report["lengths"] if r["methods"]]
    if passes:
        lines += ["", "| L | ppl dense | oracle | flat | hier | top-1 flat/dense | hier/dense | "
                  "hier/flat | recall | IoU | mass flat | mass hier | probes dense | flat | hier |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [_table_row(r) for r in passes]
        reuse = [row for r in passes for row in _reuse_rows(r)]
        if reuse:
            lines += ["", "Per-layer reuse of selections (ModelConfig.indexer_types; freqN: "
                      "layers 0, N, 2N, ... run their indexer, the others reuse the last one's "
                      "selection):", "",
                      "| L | method | ppl | vs dense | vs its base | top-1 vs dense | vs base |",
                      "|---|---|---|---|---|---|---|"] + reuse
    if selection_only:
        lines += ["", "Selection only (the dense pass's own indexer inputs, last queries):", "",
                  "| L | recall | IoU | mass flat | mass hier | mass hier / flat |",
                  "|---|---|---|---|---|---|"]
        for r in selection_only:
            s = r["selection"]
            lines.append(f"| {r['length']} | {s['recall_sparse_layers']:.4f} | "
                         f"{s['iou_sparse_layers']:.4f} | {s['mass_flat_sparse_layers']:.4f} | "
                         f"{s['mass_hier_sparse_layers']:.4f} | {s['mass_ratio']:.4f} |")
    if probed:
        extra = sorted({m for r in probed for m in r["retrieval"] if split_method(m)[1]})
        lines += ["", "Retrieval probes: tokens right (95% interval over sequences; sparse: "
                  "difference to dense on the same sequences), probes right exactly "
                  "(Wilson 95% interval):", "",
                  "| L | probe | dense | oracle | sparse flat | sparse hier |"
                  + "".join(f" {m} |" for m in extra),
                  "|---|---|---|---|---|---|" + "---|" * len(extra)]
        for r in probed:
            pk = r["retrieval"]
            cells = [_probe_cell(pk[m]) if m in pk else "-" for m in METHODS + tuple(extra)]
            lines.append(f"| {r['length']} | {pk['kind']} | " + " | ".join(cells) + " |")
    for r in probed:
        pk = r["retrieval"]
        if pk["kind"] != "needle":
            continue
        shown = [m for m in pk if m in METHODS or split_method(m)[1]]
        lines += ["", f"Needles at L={r['length']} by depth (share of the filler before the "
                  "needle): teacher-forced tokens right / generated exactly", "",
                  "| depth | contexts | " + " | ".join(shown) + " |",
                  "|---|---|" + "---|" * len(shown)]
        for depth, row in pk[shown[0]]["by_depth"].items():
            cells = [f"{pk[m]['by_depth'][depth]['teacher_forced']:.1%} / "
                     f"{pk[m]['by_depth'][depth]['generated_exact']:.1%}" for m in shown]
            lines.append(f"| {depth} | {row['contexts']} | " + " | ".join(cells) + " |")
        if "dense" in pk:
            below = []
            for m in shown:
                if m != "dense":
                    k, n = contexts_below(pk[m]["scores"], pk["dense"]["scores"],
                                          pk["per_sequence"])
                    below.append(f"{m} {k} of {n}")
            lines += ["", "Needles below dense (a context whose questions' mean teacher-forced "
                      "share is below dense's): " + ", ".join(below)]
    lines += ["", f"Command: `{report['command']}`", ""]
    return "\n".join(lines)
