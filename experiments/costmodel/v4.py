"""DeepSeek-V4-Flash and V4-Pro in the cost model: flat vs hierarchical selection over
their compressed entries, TTFT and the indexer's share at 128K-1M tokens on 8 x H200 and
8 x H100, counted as dosa runs the models (model.costs with model/deepseek_v4/costs.py; the
`deepseek-v4-flash` and `deepseek-v4-pro` presets) at the H200 kernels' calibrated rates.

    python -m experiments.costmodel v4 [--lengths 131072,262144,524288,1048576] [--out DIR]

Writes OUT/costmodel_v4.json and .md (default runs/costmodel_v4/). A projection, not a
measurement: no V4 checkpoint has run on a GPU here.
"""

import argparse
import pathlib

from experiments.common import add_out_argument, display_path, recorded_command, write_json
from experiments.costmodel.dsa import SETUPS, ttft_rows
from experiments.costmodel.rates import KERNEL_JSON, kernel_calibration
from model import get_config
from model.cache import bytes_per_token, layer_state_bytes
from model.costs import parameter_count

MODELS = (("DeepSeek-V4-Flash", "deepseek-v4-flash"), ("DeepSeek-V4-Pro", "deepseek-v4-pro"))
# Hierarchical block sizes (entries) counted, each with the recall against flat it had on
# the tiny V4 fixture at a budget ranking 0.438 of the entries (experiments.benchmarks.
# v4_entries, docs/models.md): the preset's 4, and 16 (64 positions, V3.2's block).
VARIANTS = ((4, 0.967), (16, 0.891))


def markdown(result):
    return "\n\n".join(_model_markdown(m) for m in result["models"]) + "\n\n" + NOTE


NOTE = ("Deployments, rates and what is not modelled: as the DeepSeek-V3.2 table "
        "(docs/costmodel.md). V4 specifics: every layer reads its window of 128 keys; a CSA "
        "layer the top_k of its entries (one per 4 positions) its indexer chose (512 in "
        "V4-Flash, 1024 in V4-Pro), an HCA layer every entry (one per 128); the CSA indexer "
        "scores entries, so flat selection is L x L / 4 pairs per CSA layer. The "
        "hierarchical budget is 4 x top_k entries. Memory is not modelled: V4-Pro's 1.57T "
        "parameters fit 8 GPUs only in the release's FP8 / FP4 form. dosa runs V4 on one "
        "device's mesh today (no sequence-sharded V4 cache, weights replicated): both 8-GPU "
        "columns are what the counted work would take there.")


def _model_markdown(model):
    c = model
    lines = [f"## {c['label']} (preset {c['preset']}), projected", "",
             f"{c['parameters'] / 1e9:.1f}B parameters, {c['active_parameters'] / 1e9:.1f}B "
             f"active; cache {c['bytes_per_token']:,.0f} B per token over all layers "
             f"(entries, indexer entries, summaries) plus {c['state_bytes'] / 2**20:.1f} MiB of "
             "windows and compressor tails per request.", "",
             "| hierarchical | fixture recall | GPUs | L | flat TTFT s | hier TTFT s | "
             "flat / hier | indexer share flat | hier | tensor=8: flat s | hier s |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in model["variants"]:
        for r in v["rows"]:
            lines.append(
                f"| {v['hierarchical']} | {v['fixture_recall']} | {r['devices']}x "
                f"{r['hardware'].upper()} | {r['length'] // 1024}K | {r['flat_ttft_s']:.2f} | "
                f"{r['hierarchical_ttft_s']:.2f} | {r['ttft_ratio']:.2f}x | "
                f"{r['indexer_share_flat']:.0%} | {r['indexer_share_hierarchical']:.0%} | "
                f"{r['tensor_flat_ttft_s']:.2f} | {r['tensor_hierarchical_ttft_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="131072,262144,524288,1048576")
    p.add_argument("--hardware", default="h200,h100", help="GPUs, 8 of each")
    add_out_argument(p, "costmodel_v4")
    args = p.parse_args(argv)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    setups = tuple((hw, n) for hw, n in SETUPS if hw in args.hardware.split(","))
    calibration = kernel_calibration(KERNEL_JSON)
    result = {"command": recorded_command("experiments.costmodel v4", argv),
              "calibration": display_path(KERNEL_JSON), "models": []}
    for label, preset in MODELS:
        base = get_config(preset)
        model = {"label": label, "preset": preset, "parameters": parameter_count(base),
                 "active_parameters": parameter_count(base, active=True),
                 "bytes_per_token": sum(bytes_per_token(base).values()),
                 "state_bytes": sum(layer_state_bytes(base, i) for i in range(base.n_layers)),
                 "variants": []}
        for block, recall in VARIANTS:
            config = base.replace(hierarchical=base.hierarchical.replace(block_size=block))
            h = config.hierarchical
            model["variants"].append({
                "hierarchical": f"blocks of {h.block_size} entries, {h.candidate_tokens} "
                                f"candidate entries per query, tiles of {h.query_tile}",
                "fixture_recall": recall,
                "rows": ttft_rows(calibration, [(label, config)], lengths, setups)})
        result["models"].append(model)
    result["markdown"] = markdown(result)
    out = pathlib.Path(args.out)
    write_json(out / "costmodel_v4.json", result)
    (out / "costmodel_v4.md").write_text(result["markdown"] + "\n")
    print(result["markdown"])
    print(f"wrote {display_path(out / 'costmodel_v4.json')}")
    return result


if __name__ == "__main__":
    main()
