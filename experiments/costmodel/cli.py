"""Cost model of a dosa prefill: FLOPs, bytes and predicted time per stage, flat vs
hierarchical indexer, on a CPU or on datasheet GPUs; validated against committed measurements.

    python -m experiments.costmodel [--preset small | --checkpoint [DIR]]
        [--lengths 8192,16384,...] [--hardware cpu,a100,h100,h200] [--devices N]
        [--reuse freqN|FSFS...] [--out DIR] [--no-calibrate] [--no-dsa]

Stages of a prefill of L tokens, per layer and summed (model.costs):
  other      projections (attention, indexer, MLP: 2 x parameters x tokens), norms, RoPE,
             residuals, cache writes, embedding and lm_head;
  indexer    flat: 2 H_I d_I FLOPs per scored (query, key) pair + lax.top_k over each row;
             streaming: flat's products over key tiles, a top-k per tile and a merge;
             hierarchical: coarse products with the block means, candidate-block top-k,
             tile tables, fine products over each tile's table, ranking (top-k or sort);
  attention  sparse: 2 x 2 H D FLOPs per selected token + gathering its K/V rows;
             dense causal attention is counted beside it for comparison.
--reuse: selection reuse across layers (ModelConfig.indexer_types; freqN or an F/S string
per layer): shared layers run no indexer and cache no index keys.
Seconds (experiments.costmodel.rates): measured rates on "cpu" (this machine, in this run),
datasheet peaks x efficiencies from results/gpu/pallas_bench_h200.json on GPUs.
Also: bytes per token of every cache, the longest context a device holds, the validation
against the committed CPU and H200 measurements (seconds, and flat / hierarchical ratios,
which do not depend on the machine's speed), and the DeepSeek-V3.2 / GLM-5 table in their
real architectures (experiments.costmodel.dsa). Writes OUT/costmodel.json and
OUT/costmodel.md (--out, default runs/costmodel/). --no-calibrate skips the CPU
measurements (about five seconds on two shared cores) and with them the "cpu" rows.
"""

import argparse
import dataclasses
import os
import pathlib
import sys

from experiments.common import (
    add_out_argument,
    display_path,
    machine_description,
    recorded_command,
    write_json,
)
from experiments.costmodel.cpu_rates import measure_cpu_rates
from experiments.costmodel.dsa import dsa_result
from experiments.costmodel.rates import (
    HARDWARE,
    HARDWARE_CHOICES,
    KERNEL_JSON,
    STAGE_RULE,
    gpu_rates,
    kernel_calibration,
    predict,
)
from experiments.costmodel.sharding import expert_combine_op
from experiments.costmodel.validate import (
    cpu_frontier_rows,
    cpu_prefill_rows,
    cpu_selection_rows,
    frontier_model_config,
    h200_rows,
    ratio_rows,
    summary,
)
from model import PRESETS, get_config
from model.config import reuse_types
from model.costs import (
    STAGES,
    cache_bytes_per_token,
    index_key_bytes,
    max_context,
    model_cache_bytes_per_token,
    parameter_count,
    prefill_counts,
)

NAME = "costmodel"
DEFAULT_LENGTHS = "8192,16384,32768,65536,131072"


def _int_list(text, flag, parser):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"{flag}: expected comma-separated positive ints, got {text!r}")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.costmodel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default=None,
                     help="model config preset (default small)")
    src.add_argument("--checkpoint", nargs="?", const="", default=None, metavar="DIR",
                     help="the config stored with a checkpoint (no DIR: the shipped one)")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="context lengths, tokens")
    p.add_argument("--hardware", default="cpu,a100,h100,h200",
                   help=f"comma-separated, from {','.join(HARDWARE_CHOICES)}")
    p.add_argument("--devices", type=int, default=1,
                   help="GPUs per prefill, sequence parallel (cpu: always 1)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the CPU measurements (drops the cpu predictions and validation)")
    p.add_argument("--no-dsa", action="store_true",
                   help="skip the DeepSeek-V3.2 / GLM-5 section (about 30 s of tracing their "
                        "full-size shapes for the weights per device)")
    p.add_argument("--reuse", default=None, metavar="freqN|FSFS...",
                   help="selection reuse across layers: layers 0, N, 2N, ... run their indexer "
                        "(freqN), or one letter per layer (F runs its indexer, S reuses)")
    add_out_argument(p, NAME)
    args = p.parse_args(argv)
    args.lengths = _int_list(args.lengths, "--lengths", p)
    args.hardware = [h.strip().lower() for h in args.hardware.split(",") if h.strip()]
    bad = [h for h in args.hardware if h not in HARDWARE_CHOICES]
    if bad or not args.hardware:
        p.error(f"--hardware: unknown {bad or args.hardware!r}; choose from "
                f"{','.join(HARDWARE_CHOICES)}")
    if args.devices < 1:
        p.error(f"--devices: must be a positive int, got {args.devices}")
    if args.checkpoint is not None:
        from model.checkpoint import default_checkpoint_dir, has_checkpoint
        args.checkpoint = pathlib.Path(args.checkpoint or default_checkpoint_dir())
        if not has_checkpoint(args.checkpoint):
            p.error(f"--checkpoint: no saved checkpoint under {args.checkpoint}")
    return args


def load_config(args):
    """(name, ModelConfig) from --preset or --checkpoint, with --reuse's indexer_types."""
    if args.checkpoint is None:
        name = args.preset or "small"
        config = get_config(name)
    else:
        from model.checkpoint import read_config
        config, _ = read_config(args.checkpoint.resolve())
        name = f"checkpoint {display_path(args.checkpoint)}"
    if args.reuse:
        config = config.replace(indexer_types=reuse_types(args.reuse))
        name += f", reuse {args.reuse}"
    return name, config


def count_rows(config, L):
    """FLOPs and bytes per stage: one flat layer, one hierarchical layer, and the whole
    prefill with every layer flat / hierarchical (skip=True: causal work only)."""
    out = {}
    for kind in ("flat", "hierarchical"):
        counts = prefill_counts(config, L, skip=True, indexer=kind)
        out[f"layer_{kind}"] = counts.layer(kind).totals()
        out[f"prefill_{kind}"] = counts.total().totals()
    return out


def predictions(config, lengths, rates_by_hw, devices):
    """Flat, streaming and hierarchical prefill predictions per hardware and length (GPUs on
    `devices` devices, the CPU on one)."""
    rows = []
    full = sum(not config.layer_is_shared(i) for i in range(config.n_layers))
    for hw, rates in rates_by_hw.items():
        n_dev = 1 if hw == "cpu" else devices
        for L in lengths:
            row = {"hardware": hw, "devices": n_dev, "length": L}
            for kind in ("flat", "streaming", "hierarchical"):
                counts = prefill_counts(config, L, skip=hw != "cpu", indexer=kind)
                pred = predict(counts, rates, devices=n_dev, length=L, n_layers=full,
                               index_key_bytes=index_key_bytes(config),
                               comm=[expert_combine_op(config, L, n_dev)])
                row[kind] = pred
            row["ttft_ratio"] = row["flat"]["ttft_s"] / row["hierarchical"]["ttft_s"]
            rows.append(row)
    return rows


def capacity(config, rates_by_hw, devices):
    """Cache bytes per token, weight bytes and the longest context per hardware (weights
    replicated: model.memory's count of the parameters as dosa creates them)."""
    from model.memory import param_bytes_per_device

    per_token, summed = cache_bytes_per_token(config), model_cache_bytes_per_token(config)
    weights = param_bytes_per_device(config, {})[1]
    out = {"bytes_per_token_per_layer": per_token, "bytes_per_token": summed,
           "parameters": parameter_count(config), "weight_bytes": weights,
           "max_context_tokens": {}}
    for hw, rates in rates_by_hw.items():
        mem = rates.memory_bytes
        for n in sorted({1, 1 if hw == "cpu" else devices}):
            out["max_context_tokens"][f"{hw} x{n}"] = (
                max_context(mem, weights, summed, 1, n) if mem else None)
    return out


def _physical_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _fmt_s(x):
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def markdown(result):
    s = result["setup"]
    lines = [f"# Cost model: {s['model']}", "", f"Made by `{s['command']}`.", "",
             f"Stage time: {STAGE_RULE}.", "", "## Counts (causal work, GPU kernels)", "",
             "| L | stage | flat layer GFLOP | flat layer GB | hier layer GFLOP | hier layer GB "
             "| prefill flat GFLOP | prefill hier GFLOP |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for L, c in result["counts"].items():
        for st in (*STAGES, "dense_attention"):
            def g(part, key, st=st, c=c):
                return c[part].get(st, {}).get(key, 0.0) / 1e9
            lines.append(f"| {L} | {st} | {g('layer_flat', 'flops'):.3g} | "
                         f"{g('layer_flat', 'bytes'):.3g} | {g('layer_hierarchical', 'flops'):.3g}"
                         f" | {g('layer_hierarchical', 'bytes'):.3g} | "
                         f"{g('prefill_flat', 'flops'):.4g} | "
                         f"{g('prefill_hierarchical', 'flops'):.4g} |")
    lines += ["", "## Predicted prefill", "",
              "| hardware | L | flat TTFT | indexer share | split other/indexer/attention | "
              "streaming TTFT | hier TTFT | indexer share | split | flat / hier | dense TTFT |",
              "|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in result["predictions"]:
        f, h = r["flat"], r["hierarchical"]
        fs, hs = ("/".join(f"{p['split'][k]:.0%}" for k in STAGES) for p in (f, h))
        lines.append(f"| {r['hardware']} x{r['devices']} | {r['length']} | {_fmt_s(f['ttft_s'])}"
                     f" | {f['indexer_share']:.0%} | {fs} | {_fmt_s(r['streaming']['ttft_s'])} | "
                     f"{_fmt_s(h['ttft_s'])} | "
                     f"{h['indexer_share']:.0%} | {hs} | {r['ttft_ratio']:.2f}x | "
                     f"{_fmt_s(f['dense_ttft_s'])} |")
    cap = result["caches"]
    lines += ["", "## Caches", "", "| cache | bytes per token per layer | bytes per token |",
              "|---|---:|---:|"]
    for k, v in cap["bytes_per_token_per_layer"].items():
        lines.append(f"| {k} | {v:.1f} | {cap['bytes_per_token'][k]:.1f} |")
    lines += ["", f"Weights: {cap['weight_bytes'] / 1e9:.3f} GB. Longest context (memory minus "
              "weights; KV split over the devices, indexer keys and summaries on each): " +
              ", ".join(f"{k}: {'n/a' if v is None else f'{v:,} tokens'}"
                        for k, v in cap["max_context_tokens"].items())]
    lines += ["", "## Validation against measured points", "",
              "| where | what | L | predicted | measured | error | note |",
              "|---|---|---:|---:|---:|---:|---|"]
    for r in result["validation"]["rows"]:
        lines.append(f"| {r['where']} | {r['what']} | {r['length']} | {_fmt_s(r['predicted_s'])} "
                     f"| {_fmt_s(r['measured_s'])} | {r['error']:+.0%} | {r['note']} |")
    lines += ["", "Flat / hierarchical ratios (independent of the machine's speed at calibration):",
              "", "| where | ratio | L | predicted | measured | error |",
              "|---|---|---:|---:|---:|---:|"]
    for r in result["validation"]["ratios"]:
        lines.append(f"| {r['where']} | {r['what']} | {r['length']} | {r['predicted']:.2f}x | "
                     f"{r['measured']:.2f}x | {r['error']:+.0%} |")
    for where, summ in result["validation"]["summary"].items():
        if summ:
            lines.append(f"\n{where}: {summ['rows']} out-of-sample rows at >= "
                         f"{summ['min_length']} tokens, median |error| "
                         f"{summ['median_abs_error']:.0%}, max {summ['max_abs_error']:.0%}, "
                         f"{summ['within_30_percent']} within 30%.")
    if result["dsa_models"]:
        lines += ["", result["dsa_models"]["markdown"]]
    lines += ["", "## Assumptions", ""] + [f"- {a}" for a in result["assumptions"]]
    lines += ["", "## Rates", ""]
    for hw, info in result["hardware"].items():
        lines.append(f"- {hw}: " + "; ".join(f"{k}: {v}" for k, v in info["sources"].items()))
    return "\n".join(lines)


def assumptions(calibrated):
    return [
        f"Stage time: {STAGE_RULE}.",
        "The prefill runs as ModelRunner does: chunks of prefill_chunk queries, each reading "
        "keys up to the next power of two past its end; flat top-k runs over those whole rows.",
        "CPU: the jnp references compute every masked entry (full query x key rectangles, all "
        "top_k attention entries); GPU: the Pallas kernels skip future tiles, invalid table "
        "columns and unused attention entries (causal work only).",
        "The indexer stage is the selection (scores, top-k, tables); the indexer's projections "
        "are in 'other', with every projection.",
        "Cache capacity: weights replicated on each device, activations and workspace not "
        "counted.",
        "cpu rows: rates measured in this run, per loop step (the time of S steps minus "
        "one step, over S - 1; best of 3 interleaved calls): what a call pays once (fresh "
        "buffers) and what XLA fuses across ops in one call are not modeled, and the rates "
        "carry whatever load other processes put on the cores." if calibrated else
        "--no-calibrate: no cpu rates, so no cpu predictions or cpu validation.",
    ]


def main(argv=None):
    args = parse_args(argv)
    try:
        name, config = load_config(args)
    except ValueError as e:  # a --reuse pattern the model's layers do not fit
        print(f"python -m experiments.costmodel: error: --reuse {args.reuse}: {e}",
              file=sys.stderr)
        raise SystemExit(2) from None
    calibration = kernel_calibration(KERNEL_JSON)
    rates = {}
    small = get_config("small")
    cpu_small = None
    if "cpu" in args.hardware and not args.no_calibrate:
        cpu_small = measure_cpu_rates(small)
        same = all(getattr(config, f) == getattr(small, f) for f in (
            "index_heads", "index_dim", "top_k", "n_heads", "n_kv_heads", "head_dim",
            "dtype", "hierarchical"))
        rates["cpu"] = cpu_small if same else measure_cpu_rates(config)
        rates["cpu"].memory_bytes = _physical_memory()
    for hw in args.hardware:
        if hw != "cpu":
            rates[hw] = gpu_rates(hw, config.dtype, calibration)
    validation = []
    if cpu_small is not None:
        validation += cpu_prefill_rows(cpu_small) + cpu_selection_rows(cpu_small)
        frontier_config = frontier_model_config()
        if frontier_config is not None:
            validation += cpu_frontier_rows(measure_cpu_rates(frontier_config), frontier_config)
    validation += h200_rows(calibration, KERNEL_JSON)
    ratios = ratio_rows(validation)
    result = {
        "setup": {"model": name, "config": config.to_dict(), "lengths": args.lengths,
                  "hardware": args.hardware, "devices": args.devices,
                  "calibrated": not args.no_calibrate, "stage_time_rule": STAGE_RULE,
                  "machine": machine_description(),
                  "command": recorded_command("experiments.costmodel", argv)},
        "hardware": {hw: {**({"datasheet": dataclasses.asdict(HARDWARE[hw])}
                             if hw in HARDWARE else {}),
                          **r.to_dict()} for hw, r in rates.items()},
        "counts": {str(L): count_rows(config, L) for L in args.lengths},
        "predictions": predictions(config, args.lengths, rates, args.devices),
        "caches": capacity(config, rates, args.devices),
        "validation": {"rows": validation, "ratios": ratios, "summary": {
            **{where: summary([r for r in validation if r["where"] == where])
               for where in ("cpu", "h200")},
            **{f"{where} ratios": summary([r for r in ratios if r["where"] == where])
               for where in ("cpu", "h200")}}},
        "dsa_models": None if args.no_dsa else dsa_result(
            calibration, HARDWARE["h200"].memory_gb * 1e9),
        "assumptions": assumptions(not args.no_calibrate),
    }
    result["markdown"] = markdown(result)
    print(result["markdown"])
    out = pathlib.Path(args.out)
    (out / "costmodel.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "costmodel.md").write_text(result["markdown"] + "\n")
    print(f"wrote {write_json(out / 'costmodel.json', result)} and {out / 'costmodel.md'}")
    return result


if __name__ == "__main__":
    main()
