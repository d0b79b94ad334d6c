"""The study's outputs: a console table, report.md and a PNG (TTFT vs length, split)."""

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = ("tokens", "mode", "TTFT ms (min; median [max])", "indexer ms", "attention ms",
           "other ms", "indexer share", "decode ms/step", "recall", "IoU",
           "top-1 vs ref", "KL vs ref", "top-1 vs dense")


def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def row_cells(r):
    if r.get("skipped"):
        return [str(r["context_len"]), r["mode"], f"skipped: {r['skipped']}"] + [""] * 10
    t = r["ttft_ms"]
    decode = r.get("decode_step_ms")
    return [str(r["context_len"]), r["mode"],
            f"{t['min']:.0f}; {t['median']:.0f} [{t['max']:.0f}]",
            _f(r["indexer_ms"], ".0f"), _f(r["attention_ms"], ".0f"), _f(r["other_ms"], ".0f"),
            _f(r["indexer_share"], ".2f"), _f(decode and decode["median"], ".2f"),
            _f(r["recall"], ".4f"), _f(r["iou"], ".4f"), _f(r["top1_agreement"], ".4f"),
            _f(r["logit_kl"], ".4f"), _f(r.get("top1_agreement_vs_dense"), ".4f")]


def summary_line(s):
    if s.get("context_len") is None:
        return "Summary: the reference and compare modes never ran at the same length."
    parts = [f"at {s['context_len']} tokens, TTFT({s['compare']}) / TTFT({s['reference']}) "
             f"= {s['ttft_ratio']:.3f}",
             f"indexer share {s['indexer_share_flat']:.2f} -> "
             f"{s['indexer_share_hierarchical']:.2f}"]
    if s.get("recall") is not None:
        parts.append(f"recall {s['recall']:.4f}, top-1 agreement {s['top1_agreement']:.4f} "
                     f"(vs {s['reference']})")
    if s.get("decode_step_ratio") is not None:
        parts.append(f"decode step ratio {s['decode_step_ratio']:.2f}")
    return "Summary: " + "; ".join(parts) + "."


def markdown(results):
    cfg, env = results["config"], results["env"]
    lines = ["# dosa TTFT study", "",
             f"Command: `{results['command']}`", "",
             f"Model: {results['model']}. "
             f"Device: {env['device']} ({env['backend']}, jax {env['jax']}). "
             f"Repetitions: {cfg['repetitions']} timed prefills per row after a compile-only "
             f"warm-up, the modes and baselines of a length interleaved; ratios and the split "
             f"from each row's fastest run; wall time {results['wall_s']:.0f} s.", "",
             summary_line(results["summary"]), ""]
    if results["random_weights"]:
        lines += ["Random weights: timing only; no fidelity figures.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in results["runs"]]
    lines += ["", "Residual of the split: none by construction - indexer, attention and other are "
              "differences of measured TTFTs (the mode's and two selection-free baselines', "
              "below), so they add up to the measured TTFT exactly; their uncertainty is the "
              "spread of the timed runs (TTFT min-max), and a part can come out slightly "
              "negative when it is smaller than that spread.", "",
              "| tokens | mode | baseline window top_k ms | baseline window top_k=1 ms |",
              "|---|---|---:|---:|"]
    for r in results["runs"]:
        if not r.get("skipped"):
            b = r.get("baselines_ms") or {}
            lines.append(f"| {r['context_len']} | {r['mode']} | "
                         f"{_f(b.get('window_top_k'), '.0f')} | "
                         f"{_f(b.get('window_top_1'), '.0f')} |")
    lines += ["", "How each figure is measured:", ""]
    lines += [f"- {name}: {text}." for name, text in results["method"].items()]
    lines += ["", "![TTFT and its split](ttft.png)", ""]
    return "\n".join(lines)


def plot(results, path):
    """TTFT vs length per mode (left); the split of each run, modes side by side (right)."""
    runs = [r for r in results["runs"] if not r.get("skipped")]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for mode in modes:
        pts = sorted((r["context_len"], r["ttft_ms"]["min"] / 1000, r.get("recall"))
                     for r in runs if r["mode"] == mode)
        left.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        for x, y, recall in pts:  # fidelity beside speed: recall vs the reference
            if recall is not None:
                left.annotate(f"recall {recall:.3f}", (x, y), textcoords="offset points",
                              xytext=(5, -10), fontsize=7)
    left.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT (s, fastest run)",
             title="Time to first token")
    left.legend()
    lengths = sorted({r["context_len"] for r in runs})
    width = 0.8 / max(1, len(modes))
    colors = {"indexer_ms": "tab:red", "attention_ms": "tab:blue", "other_ms": "tab:gray"}
    for m, mode in enumerate(modes):
        for i, length in enumerate(lengths):
            r = next((x for x in runs if x["mode"] == mode and x["context_len"] == length), None)
            if r is None:
                continue
            x, bottom = i + (m - (len(modes) - 1) / 2) * width, 0.0
            for part, color in colors.items():
                value = max(0.0, r[part]) / 1000
                right.bar(x, value, width, bottom=bottom, color=color,
                          label=part[:-3] if (m, i) == (0, 0) else None)
                bottom += value
            right.text(x, bottom, mode.replace("sparse-", ""), rotation=90, ha="center",
                       va="bottom", fontsize=7)
    right.set_xticks(range(len(lengths)), [str(L) for L in lengths])
    right.set(xlabel="context tokens", ylabel="seconds",
              title="Prefill split (indexer / attention / other)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
