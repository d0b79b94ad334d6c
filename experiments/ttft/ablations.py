"""The ablations' saved results, as rows a table or a plot can use (notebooks/ablations.ipynb).

Each ablation is one `python -m experiments.run --config experiments/configs/ablations/<name>.yaml
--out <folder>/<name>` run; its `<folder>/<name>/results.json` follows the main job's schema
(experiments/run.py). Pure functions over the loaded dicts; nothing here measures or plots.
"""

import json
import pathlib

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs" / "ablations"

TABLE_COLUMNS = ("tokens", "variant", "speedup", "recall", "IoU", "top-1", "KL",
                 "indexer share", "decode ratio")


def ablation_names():
    """The shipped ablation configs' names (experiments/configs/ablations/<name>.yaml), sorted."""
    return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def load_ablations(folder):
    """-> {name: results dict} for every `<folder>/<name>/results.json`, sorted by name; {} when
    `folder` does not exist. A results.json that is not valid JSON raises ValueError naming it."""
    folder = pathlib.Path(folder)
    loaded = {}
    for path in sorted(folder.glob("*/results.json")):
        try:
            loaded[path.parent.name] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    return loaded


def missing_ablations(folder, names=None):
    """The ablation names (default: the shipped configs) with no `<folder>/<name>/results.json`."""
    folder = pathlib.Path(folder)
    names = ablation_names() if names is None else names
    return [n for n in names if not (folder / n / "results.json").is_file()]


def _ratio(numerator, denominator):
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _stat(row, key, stat):
    value = row.get(key) if not row.get("skipped") else None
    return value[stat] if value else None


def ablation_rows(results):
    """One dict per run of one ablation's results, in the saved order:
    context_len, mode, reference (bool: this is the reference mode), skipped (the reason or
    None), speedup = TTFT(reference) / TTFT(mode) at the same length (fastest runs), recall, iou,
    top1_agreement, logit_kl (vs the reference), indexer_share, decode_ratio = decode step
    time(mode) / decode step time(reference). A figure that was not measured (a skipped run,
    the reference's missing run at that length, random weights) is None."""
    reference = results["config"]["reference"]
    runs = results["runs"]
    ref_at = {r["context_len"]: r for r in runs
              if r["mode"] == reference and not r.get("skipped")}
    rows = []
    for r in runs:
        ref = ref_at.get(r["context_len"])
        ref_ttft = _stat(ref, "ttft_ms", "min") if ref else None
        ref_decode = _stat(ref, "decode_step_ms", "median") if ref else None
        rows.append({
            "context_len": r["context_len"], "mode": r["mode"],
            "reference": r["mode"] == reference, "skipped": r.get("skipped") or None,
            "speedup": _ratio(ref_ttft, _stat(r, "ttft_ms", "min")),
            "recall": r.get("recall"), "iou": r.get("iou"),
            "top1_agreement": r.get("top1_agreement"), "logit_kl": r.get("logit_kl"),
            "indexer_share": r.get("indexer_share"),
            "decode_ratio": _ratio(_stat(r, "decode_step_ms", "median"), ref_decode)})
    return rows


def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def row_cells(row):
    """The TABLE_COLUMNS cells of one ablation_rows() row, as strings."""
    name = row["mode"] + (" (ref)" if row["reference"] else "")
    if row["skipped"]:  # the reason is long: skipped_notes() gives it under the table
        return [str(row["context_len"]), name, "skipped"] + ["-"] * 6
    return [str(row["context_len"]), name, _f(row["speedup"], ".3f"),
            _f(row["recall"], ".4f"), _f(row["iou"], ".4f"), _f(row["top1_agreement"], ".4f"),
            _f(row["logit_kl"], ".4f"), _f(row["indexer_share"], ".2f"),
            _f(row["decode_ratio"], ".2f")]


def skipped_notes(rows):
    """One line per skipped run of ablation_rows(): "<mode> at <tokens> tokens: <reason>"."""
    return [f"{r['mode']} at {r['context_len']} tokens: {r['skipped']}" for r in rows
            if r["skipped"]]
