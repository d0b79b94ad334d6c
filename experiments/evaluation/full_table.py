"""The evaluation's full table, gathered from the runs of record: every probe and length,
dense / oracle / sparse flat / sparse hierarchical side by side, per indexer and setting.

    python -m experiments.evaluation.full_table [--results results/pretrained] [--out FILE]

Reads every eval.json (experiments.evaluation.pretrained) and proxy.json
(experiments.evaluation.proxy) under --results. A row is one indexer, probe (or perplexity),
length and setting (top_k, dense layers, index_rope_scaling; for perplexity also the number
of windows, since only the same windows compare); its cells are the methods. Where several
runs measured the same cell, the one with the most sequences (then windows) is shown, and
the row names every folder it draws on. Retrieval cells: tokens right with a 95% interval
over sequences, and the paired difference to dense on the same sequences; perplexity cells:
the perplexity and its gap to dense (interval over paired windows). The hierarchical cell
names its candidate budget: at or above the context it equals flat by construction. Writes
markdown to stdout and to --out when given.
"""

import argparse
import functools
import json
import pathlib

from experiments.common import display_path, recorded_command
from experiments.evaluation.needles import contexts_below
from model.pretrained.registry import file_sha256

COLUMNS = ("dense", "oracle", "sparse_flat", "sparse_hier")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = REPO_ROOT / "results" / "pretrained"


def _setting(config):
    if "top_k" not in config:  # a proxy.json from before the proxy recorded its setting
        return "setting not recorded (the indexer's own top_k)"
    dense = config.get("dense_layers") or []
    rope = config.get("index_rope_scaling")
    parts = [f"top_k {config.get('top_k')}"]
    if dense:
        parts.append(f"dense layers {list(dense)}")
    if rope:
        parts.append(f"index rope x{rope:g}")
    return ", ".join(parts)


def _pct(x):
    return f"{100 * x:.1f}"


def _interval(lo_hi, sign=True, digits=1):
    lo, hi = lo_hi
    fmt = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"[{fmt.format(100 * lo)}, {fmt.format(100 * hi)}]"


def _cell_key(method, budget):
    base, _, reuse = method.partition("@")
    column = base if base in COLUMNS and not reuse else "other"
    label = method + (f" (budget {budget})" if base == "sparse_hier" else "")
    return column, label


def _entries(path):
    """One eval.json or proxy.json -> [(row key, column, label, measure, cell dict)]; a row
    key's indexer is its weights' sha256 where recorded (a folder's weights change when a
    better indexer is shipped), else its folder; the cell names the folder."""
    data = json.loads(path.read_text())
    folder = display_path(path.parent)
    out = []
    if path.name == "proxy.json":
        named = data["indexer"]
        indexer, setting = data.get("indexer_sha256") or named, _setting(data.get("config", {}))
        for run in data.get("copy", []):
            if (path.parent / f"copy_{run['length']}" / "eval.json").exists():
                continue  # the proxy's own run is there, with every cell and its setting
            row = (indexer, "copy", run["length"], setting)
            out.append((row, "dense", "dense", run["sequences"],
                        {"acc": run["dense"], "folder": folder, "indexer": named}))
            column, label = _cell_key(data["method"], None)
            out.append((row, column, label, run["sequences"], {
                "acc": run["method"], "diff": run["vs_dense"], "diff_ci": run["vs_dense_ci95"],
                "folder": folder, "indexer": named}))
        return out
    info = data.get("info", {})
    named = info.get("indexer", "?")
    indexer = info.get("indexer_sha256") or named
    setting = _setting(data.get("config", {}))
    budget = data.get("hierarchical_budget")
    for length in data["lengths"]:
        L = length["length"]
        retrieval = length.get("retrieval")
        if retrieval:
            row = (indexer, retrieval["kind"], L, setting)
            dense = retrieval.get("dense")
            for method, r in retrieval.items():
                if not isinstance(r, dict) or "token_accuracy" not in r:
                    continue
                column, label = _cell_key(method, budget)
                below = None
                if retrieval["kind"] == "needle" and dense and method != "dense":
                    below = contexts_below(r["scores"], dense["scores"],
                                           retrieval["per_sequence"])
                out.append((row, column, label, retrieval["sequences"], {
                    "acc": r["token_accuracy"], "ci": r["token_ci95"],
                    "exact": (r["correct"], r["probes"]), "diff": r.get("token_vs_dense"),
                    "diff_ci": r.get("token_vs_dense_ci95"), "below": below,
                    "folder": folder, "indexer": named}))
        pairs = length.get("pairs", {})
        for method, m in (length.get("methods") or {}).items():
            if not isinstance(m, dict) or "perplexity" not in m:
                continue
            column, label = _cell_key(method, budget)
            # Perplexities compare only over the same windows: their count is in the row.
            row = (indexer, "perplexity", L, f"{setting}; {m.get('windows', 1)} window(s)")
            agreement = (pairs.get(f"{method}|dense") or {}).get("agreement")
            out.append((row, column, label, m.get("windows", 1), {
                "ppl": m["perplexity"], "gap": m.get("ppl_vs_dense"),
                "gap_ci": m.get("ppl_vs_dense_ci95"), "top1": agreement, "folder": folder,
                "indexer": named}))
    return out


def gather(results_dir):
    """-> {row key: {"cells": {column: {label: (count, cell)}}, "folders": [...]}}, the run
    with the most sequences (windows) kept per cell."""
    rows = {}
    for path in sorted(results_dir.rglob("*.json")):
        if path.name not in ("eval.json", "proxy.json"):
            continue
        for row, column, label, count, cell in _entries(path):
            slot = rows.setdefault(row, {"cells": {}})
            kept = slot["cells"].setdefault(column, {}).get(label)
            if kept is None or count > kept[0]:
                slot["cells"][column][label] = (count, cell)
    indexer_folders = {}
    for key, slot in rows.items():
        cells = [cell for labels in slot["cells"].values() for _, cell in labels.values()]
        slot["folders"] = sorted({cell["folder"] for cell in cells})
        indexer_folders.setdefault(key[0], set()).update(cell["indexer"] for cell in cells)
    names = {identity: indexer_name(identity, folders)  # hashes each folder's weights once
             for identity, folders in indexer_folders.items()}
    for key, slot in rows.items():
        slot["indexer"] = names[key[0]]
    return rows


def indexer_name(identity, folders):
    """The folders an indexer was evaluated from, with its digest; a folder that holds other
    weights today is marked "(earlier weights)", so a figure of a replaced indexer is never
    read as the shipped one's, and one not in the checkout "(not in this checkout)"; a
    committed checkpoint holding these weights today comes first, marked "(now)"."""
    if identity in folders:  # no digest recorded: the folder is all there is
        return identity
    names = []
    for folder in sorted(folders):
        weights = REPO_ROOT / folder / "indexer.safetensors"
        if not weights.is_file():
            folder += " (not in this checkout)"
        elif _sha256(weights) != identity:
            folder += " (earlier weights)"
        names.append(folder)
    # A stage evaluated from its own folder and shipped later: name where it lives now.
    names = [f"{folder} (now)" for folder, digest in _checkpoint_digests().items()
             if digest == identity and folder not in folders] + names
    return " = ".join(names) + f" [sha256 {identity[:8]}]"


@functools.cache
def _sha256(path):
    return file_sha256(path)


def _checkpoint_digests():
    """{checkpoint folder: its indexer's sha256} for every folder under checkpoints/ with an
    indexer (what this checkout holds, committed or not)."""
    return {str(weights.parent.relative_to(REPO_ROOT)): _sha256(weights)
            for weights in sorted((REPO_ROOT / "checkpoints").glob("*/indexer.safetensors"))}


def _format(label, cell, perplexity):
    if perplexity:
        text = f"{cell['ppl']:.3f}"
        if cell.get("gap") is not None:
            text += f" ({100 * cell['gap']:+.2f}%"
            if cell.get("gap_ci"):
                text += f" {_interval(cell['gap_ci'], digits=2)}"
            text += ")"
        if cell.get("top1") is not None:
            text += f"; top-1 {cell['top1']:.3f}"
    else:
        text = _pct(cell["acc"])
        if cell.get("ci"):
            text += f" {_interval(cell['ci'], sign=False)}"
        if cell.get("diff") is not None and label != "dense":
            text += f"; **{100 * cell['diff']:+.1f}**"
            if cell.get("diff_ci"):
                text += f" {_interval(cell['diff_ci'])}"
        if cell.get("exact"):
            text += f"; exact {cell['exact'][0]}/{cell['exact'][1]}"
        if cell.get("below"):
            text += f"; {cell['below'][0]} of {cell['below'][1]} contexts below dense"
    prefix = "" if label in COLUMNS else f"{label}: "
    return prefix + text


def markdown(rows):
    order = {"copy": 0, "copy_rare": 1, "needle": 2, "passkey": 3, "perplexity": 4}
    lines = ["| indexer | probe | L | setting | n | dense | oracle | sparse flat | "
             "sparse hierarchical | other | from |", "|" + "---|" * 11]
    for key in sorted(rows, key=lambda k: (rows[k]["indexer"], order.get(k[1], 9), k[2], k[3])):
        _, probe, L, setting = key
        indexer = rows[key]["indexer"]
        cells, counts = [], set()
        for column in (*COLUMNS, "other"):
            texts = []
            for label, (count, cell) in sorted(rows[key]["cells"].get(column, {}).items()):
                texts.append(_format(label, cell, probe == "perplexity"))
                counts.add(count)
            cells.append("<br>".join(texts) or "-")
        unit = "windows" if probe == "perplexity" else "seq"
        n = "/".join(str(c) for c in sorted(counts))
        lines.append(f"| {indexer} | {probe} | {L} | {setting.split(';')[0]} | {n} {unit} | "
                     + " | ".join(cells) + f" | {', '.join(rows[key]['folders'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(DEFAULT_RESULTS),
                   help="folder searched for eval.json / proxy.json (default results/pretrained)")
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    results = pathlib.Path(args.results)
    if not results.is_dir():
        p.error(f"--results {args.results}: no such folder")
    command = recorded_command("experiments.evaluation.full_table", argv)
    text = (f"Made by `{command.strip()}`.\n\n"
            "Retrieval cells: tokens right % [95% interval]; **paired difference to dense, "
            "points** [interval]; exact probes. Perplexity cells: perplexity (gap to dense "
            "[interval over windows]); top-1 agreement with dense.\n\n"
            + markdown(gather(results)))
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
