"""The study's outputs: a console table, report.md and a PNG (TTFT vs length, split)."""

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = ("tokens", "mode", "TTFT ms (min; median [max])", "indexer ms", "attention ms",
           "other ms", "indexer share", "decode ms/step", "scored share", "recall", "IoU",
           "top-1 vs ref", "KL vs ref", "top-1 vs dense", "KL vs dense", "ppl vs dense",
           "model TFLOP", "GFLOP/s (share of matmul)", "compile s")


def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def _pct(value):
    return "-" if value is None else f"{100 * value:+.2f}%"


def row_cells(r):
    if r.get("skipped"):
        return [str(r["context_len"]), r["mode"], f"skipped: {r['skipped']}"] + \
            [""] * (len(COLUMNS) - 3)
    t = r["ttft_ms"]
    decode = r.get("decode_step_ms")
    ttft = "untimed (fidelity only)" if t is None else \
        f"{t['min']:.0f}; {t['median']:.0f} [{t['max']:.0f}]"
    return [str(r["context_len"]), r["mode"], ttft,
            _f(r["indexer_ms"], ".0f"), _f(r["attention_ms"], ".0f"), _f(r["other_ms"], ".0f"),
            _f(r["indexer_share"], ".2f"), _f(decode and decode["median"], ".2f"),
            _f(r.get("scored_share"), ".3f"),
            _f(r["recall"], ".4f"), _f(r["iou"], ".4f"), _f(r["top1_agreement"], ".4f"),
            _f(r["logit_kl"], ".4f"), _f(r.get("top1_agreement_vs_dense"), ".4f"),
            _f(r.get("logit_kl_vs_dense"), ".4f"), _pct(r.get("perplexity_vs_dense")),
            _f(r.get("model_tflop"), ".2f"), _rate(r), _f(r.get("compile_s"), ".1f")]


def _rate(r):
    if r.get("achieved_gflops") is None:
        return "-"
    return f"{r['achieved_gflops']:.1f} ({r['matmul_share']:.2f})"


def _matmul_text(summary):
    m = summary.get("matmul_rate")
    if not m:
        return ""
    measured = " and ".join(f"{g:.1f}" for g in m["measured_gflops"])
    return (f"Machine limit: {m['shape']} at {m['gflops']:.1f} GFLOP/s (measured {measured} "
            f"before the first length and after the last)")


CONSOLE_WIDTH = 80


def console_lines(results):
    """The job's closing summary as plain lines of at most 80 characters (a terminal or a
    log file; the full table is report.md's): per row the TTFT, the achieved rate and its
    share of the matmul rate, recall and top-1 against the reference, perplexity against
    dense; then the comparison per length, wrapped."""
    import textwrap

    lines = [f"{'tokens':>6} {'mode':<20} {'TTFT s':>7} {'GFLOP/s':>7} {'of mm':>5} "
             f"{'recall':>6} {'top-1':>6} {'ppl/dense':>9}"]
    for r in results["runs"]:
        if r.get("skipped"):
            lines.append(f"{r['context_len']:>6} {r['mode'][:20]:<20} skipped: "
                         f"{r['skipped']}"[:CONSOLE_WIDTH])
            continue
        t = r.get("ttft_ms")
        lines.append(f"{r['context_len']:>6} {r['mode'][:20]:<20} "
                     f"{'untimed' if t is None else format(t['min'] / 1e3, '.3g'):>7} "
                     f"{_f(r.get('achieved_gflops'), '.1f'):>7} "
                     f"{_f(r.get('matmul_share'), '.2f'):>5} {_f(r['recall'], '.4f'):>6} "
                     f"{_f(r['top1_agreement'], '.4f'):>6} "
                     f"{_pct(r.get('perplexity_vs_dense')):>9}")
    machine = _matmul_text(results["summary"])
    if machine:
        lines += textwrap.wrap(machine + ".", CONSOLE_WIDTH)
    for line in summary_line(results["summary"]).split("\n"):  # one per length
        indent = " " * (len(line) - len(line.lstrip()))
        lines += textwrap.wrap(line.rstrip(), CONSOLE_WIDTH, subsequent_indent=indent + "  ")
    return lines


def comparison_line(c):
    """One length of the summary: the speedup with the fidelity it was measured at."""
    parts = [f"at {c['context_len']} tokens, TTFT({c['compare']}) / TTFT({c['reference']}) "
             f"= {c['ttft_ratio']:.3f}"]
    if c.get("indexer_share_flat") is not None:
        parts.append(f"indexer share {c['indexer_share_flat']:.2f} -> "
                     f"{c['indexer_share_hierarchical']:.2f}")
    if c.get("scored_share") is not None:
        parts.append(f"scored share {c['scored_share']:.3f}")
    if c.get("recall") is not None:
        parts.append(f"recall {c['recall']:.4f}, IoU {c['iou']:.4f}, top-1 agreement "
                     f"{c['top1_agreement']:.4f}, KL {c['logit_kl']:.4f} (vs {c['reference']})")
    if c.get("top1_agreement_vs_dense") is not None:
        parts.append(f"vs dense: top-1 {c['top1_agreement_vs_dense']:.4f}, KL "
                     f"{c['logit_kl_vs_dense']:.4f}, perplexity "
                     f"{_pct(c.get('perplexity_vs_dense'))} ({c['reference']}: "
                     f"{_pct(c.get('reference_perplexity_vs_dense'))})")
    if c.get("decode_step_ratio") is not None:
        parts.append(f"decode step ratio {c['decode_step_ratio']:.2f}")
    return "; ".join(parts)


def summary_line(s):
    if s.get("context_len") is None:
        return "Summary: the reference and compare modes never ran at the same length."
    lines = [comparison_line(c) for c in s.get("per_length") or [s]]
    return "Summary: " + ".\n         ".join(lines) + "."


def _rounds(cfg):
    timed = "the modes" + (" and baselines" if cfg.get("split", True) else "")
    if cfg["repetitions"] == 1:
        text = f"1 timed prefill per row, {timed} each timed right after its own warm-up"
    else:
        text = (f"{cfg['repetitions']} timed prefills per row after a compile-only warm-up, "
                f"{timed} of a length interleaved")
    return text + ("; ratios and the split from each row's fastest run"
                   if cfg.get("split", True) else "; ratios from each row's fastest run")


def _compile_text(summary):
    """The study's XLA compiles (counted by jax.monitoring), for the report's header."""
    c = summary.get("compiles")
    if not c or c.get("seconds") is None:
        return ""
    return f", of which {c['seconds']:.0f} s in {c['total']} XLA compiles"


def markdown(results):
    cfg, env = results["config"], results["env"]
    lines = ["# dosa TTFT study", "",
             f"Command: `{results['command']}`", "",
             f"Model: {results['model']}. "
             f"Device: {env['device']} ({env['backend']}, jax {env['jax']}). "
             f"Repetitions: {_rounds(cfg)}; wall time {results['wall_s']:.0f} s"
             + _compile_text(results["summary"]) + ".", "",
             summary_line(results["summary"]), ""]
    if _matmul_text(results["summary"]):
        lines += [_matmul_text(results["summary"]) + "; each row's achieved rate is its "
                  "model FLOPs over its fastest TTFT, and its share of that limit.", ""]
    if results["random_weights"]:
        lines += ["Random weights: timing only; no fidelity figures.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in results["runs"]]
    timed = [r for r in results["runs"] if not r.get("skipped") and r.get("ttft_ms")]
    if not any(r.get("baselines_ms") for r in timed):
        lines += ["", "Split: not measured (this run's config sets split: false; "
                      "experiments/configs/run_smollm2.yaml times it)."]
    else:
        lines += _split_table(timed)
    p = results.get("projection")
    if p and p.get("rows"):
        from experiments.ttft.projection import validation_text

        lines += ["", f"Projection (the plot's right panel; a prediction of the cost model, "
                      f"not a measurement): {p['setup']}. Validation error of the cost model's "
                      f"run of record ({p['validation_record']}): {validation_text(p)}.", "",
                  "| model | tokens | flat TTFT s | hierarchical TTFT s | flat / hierarchical |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['length']} | {r['flat_ttft_s']:.1f} | "
                  f"{r['hierarchical_ttft_s']:.1f} | "
                  f"{r['flat_ttft_s'] / r['hierarchical_ttft_s']:.2f}x |" for r in p["rows"]]
    lines += ["", "How each figure is measured:", ""]
    lines += [f"- {name}: {text}." for name, text in results["method"].items()]
    lines += ["", "![TTFT and its split](ttft.png)", ""]
    return "\n".join(lines)


def _split_table(timed):
    lines = ["", "Residual of the split: none by construction - indexer, attention and other "
             "are differences of measured TTFTs (the mode's and two selection-free baselines', "
             "below), so they add up to the measured TTFT exactly; their uncertainty is the "
             "spread of the timed runs (TTFT min-max), and a part can come out slightly "
             "negative when it is smaller than that spread.", "",
             "| tokens | mode | baseline window top_k ms | baseline window top_k=1 ms |",
             "|---|---|---:|---:|"]
    for r in timed:
        b = r.get("baselines_ms") or {}
        lines.append(f"| {r['context_len']} | {r['mode']} | "
                     f"{_f(b.get('window_top_k'), '.0f')} | {_f(b.get('window_top_1'), '.0f')} |")
    return lines


def plot(results, path):
    """TTFT vs length per mode, each point labelled with its fidelity against the reference
    (left); the split of each timed run, modes side by side (middle); the cost model's
    projection for the full DSA models on 8 x H200, labelled as one (right)."""
    runs = [r for r in results["runs"] if not r.get("skipped") and r.get("ttft_ms")]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    fig, (left, right, proj) = plt.subplots(1, 3, figsize=(19, 5.5))
    labelled = 0  # modes whose points carry a label: each mode's labels get a row of their
    # own (close TTFTs would print them over each other), in the colour of its line
    for mode in modes:
        pts = sorted((r["context_len"], r["ttft_ms"]["min"] / 1000, r) for r in runs
                     if r["mode"] == mode)
        line, = left.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        row, rightmost = labelled, max(p[0] for p in pts)
        for x, y, r in pts:  # fidelity beside speed
            label = []
            if r.get("recall") is not None:
                label.append(f"recall {r['recall']:.3f}, top-1 {r['top1_agreement']:.3f}")
            if r.get("perplexity_vs_dense") is not None:
                label.append(f"ppl vs dense {_pct(r['perplexity_vs_dense'])}")
            if label:
                last = x == rightmost  # the rightmost point's text goes to its left
                left.annotate("\n".join(label), (x, y), textcoords="offset points",
                              xytext=(-6 if last else 6, -10 - 22 * row), fontsize=7,
                              color=line.get_color(), va="top", ha="right" if last else "left")
                labelled = row + 1
    left.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT (s, fastest run)",
             title="Time to first token (measured), fidelity vs " +
                   results["config"].get("reference", "the reference"))
    left.legend()
    lengths = sorted({r["context_len"] for r in runs})
    width = 0.8 / max(1, len(modes))
    split = any(r.get("indexer_ms") is not None for r in runs)
    colors = {"indexer_ms": "tab:red", "attention_ms": "tab:blue", "other_ms": "tab:gray"}
    for m, mode in enumerate(modes):
        for i, length in enumerate(lengths):
            r = next((x for x in runs if x["mode"] == mode and x["context_len"] == length), None)
            if r is None:
                continue
            x, bottom = i + (m - (len(modes) - 1) / 2) * width, 0.0
            if not split:  # the share of the matmul rate, not the TTFTs again
                bottom = r.get("matmul_share") or 0.0
                right.bar(x, bottom, width, color="tab:olive")
            for part, color in (colors.items() if split else ()):
                value = max(0.0, r[part]) / 1000
                right.bar(x, value, width, bottom=bottom, color=color,
                          label=part.removesuffix("_ms") if (m, i) == (0, 0) else None)
                bottom += value
            right.text(x, bottom, mode.replace("sparse-", ""), rotation=90, ha="center",
                       va="bottom", fontsize=7)
    right.set_xticks(range(len(lengths)), [str(L) for L in lengths])
    if split:
        right.set(xlabel="context tokens", ylabel="seconds",
                  title="Prefill split (indexer / attention / other)")
        right.legend()
    else:
        m = results["summary"].get("matmul_rate")
        right.set(xlabel="context tokens", ylabel="model FLOP/s over f32 matmul rate",
                  title="Achieved share of the machine's matmul rate" + (
                      f" ({m['gflops']:.0f} GFLOP/s)" if m else ""))
    _projection_panel(proj, results.get("projection"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _projection_panel(ax, p):
    from experiments.ttft.projection import validation_text

    if not p or not p.get("rows"):
        ax.text(0.5, 0.5, "projection unavailable", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    for model in dict.fromkeys(r["model"] for r in p["rows"]):
        rows = sorted((r for r in p["rows"] if r["model"] == model), key=lambda r: r["length"])
        xs = [r["length"] for r in rows]
        line, = ax.plot(xs, [r["flat_ttft_s"] for r in rows], marker="o", linestyle="--",
                        label=f"{model} flat")
        ax.plot(xs, [r["hierarchical_ttft_s"] for r in rows], marker="s", color=line.get_color(),
                label=f"{model} hierarchical")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT (s, predicted)",
           title="PROJECTION, not measured: cost model, 8 x H200")
    ax.text(0.02, 0.98, "cost model's validation error (" + validation_text(p) + ")",
            transform=ax.transAxes, fontsize=7, va="top", wrap=True)
    ax.legend(fontsize=7, loc="lower right")
