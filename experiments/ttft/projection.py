"""The report's projection panel: what the cost model (experiments.costmodel) predicts for
flat vs hierarchical TTFT of the full DSA models on 8 x H200 at 128K-1M tokens. A
projection, never a measurement: it is labelled so, with the validation error the cost
model's run of record measured (results/costmodel/costmodel.json) and its platforms."""

import json

from experiments.common import REPO_ROOT

MODELS = ("DeepSeek-V3.2", "GLM-5")
RECORD = "results/costmodel/costmodel.json"


def projection():
    """{"rows": [{model, length, flat_ttft_s, hierarchical_ttft_s}], "setup", "validation"}
    (validation: {platform: {rows, median_abs_error, max_abs_error}} of the record, or None
    when the record is missing); None when the cost model cannot run here."""
    from experiments.costmodel.dsa import models, ttft_rows
    from experiments.costmodel.rates import kernel_calibration

    try:
        rows = ttft_rows(kernel_calibration(), models(MODELS), setups=(("h200", 8),))
    except (OSError, ValueError, KeyError) as e:
        return {"rows": [], "error": str(e)}
    validation = None
    record = REPO_ROOT / RECORD
    if record.exists():
        summary = json.loads(record.read_text())["validation"]["summary"]
        validation = {name: {k: summary[name][k] for k in ("rows", "median_abs_error",
                                                             "max_abs_error")}
                      for name in summary if " " not in name}  # absolute times, not ratios
    return {"setup": "8 x H200, sequence=8 + expert parallel (experiments.costmodel.dsa)",
            "validation_record": RECORD, "validation": validation,
            "rows": [{k: r[k] for k in ("model", "length", "flat_ttft_s",
                                        "hierarchical_ttft_s")} for r in rows]}


def validation_text(p):
    """'CPU: median 16%, max 48% over 36 points; H200: ...' of a projection()."""
    if not p or not p.get("validation"):
        return "not validated (no cost-model record)"
    return "; ".join(f"{name.upper()}: median {100 * v['median_abs_error']:.0f}%, max "
                     f"{100 * v['max_abs_error']:.0f}% over {v['rows']} points"
                     for name, v in p["validation"].items())
