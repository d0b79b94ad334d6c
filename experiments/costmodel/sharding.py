"""Communication and sequence-parallel scaling of a sharded prefill (model.sharding,
model.sequence_parallel), checked against the collectives XLA compiles.

    python -m experiments.costmodel sharding [--length 1048576] [--devices 1,2,4,8,16]
        [--hardware a100,h200] [--measured results/sharding/sharded.json] [--out DIR]

Per sparse layer and prefill chunk of T query rows on S sequence x TP tensor devices
(result sizes of each collective, per device; `step_collectives`):
  sequence axis: all-gather of the chunk's new indexer keys (T d_I), indexer queries and
  weights (T H_I (d_I + 1)), attention queries (T H/TP D), new K/V rows (T 2 H_kv/TP D)
  and the selected indices (T top_k int32); all-reduce of the softmax row maxima
  (T H/TP f32) and reduce-scatter of the exp-sums and weighted values (T H/TP (Dv + 1)
  f32, each shard keeping T / S rows);
  tensor axis: all-reduce of the attention output and MLP output projections
  (T/S d_model each);
  expert group (model.moe: the routed experts split over "expert" x "tensor", each device
  running its own experts' assignments for the T/S rows its group holds): one psum of the
  routed output per MoE layer (T/S d_model), 2 (n - 1) / n of it on the wire;
  head: all-reduce of the last position's logits (V f32).
The main job's cost model (experiments.costmodel.rates.predict, devices > 1) counts only the
indexer-key all-gather (and, given them, the expert-parallel combine's bytes:
expert_combine_op); `main` prints both against the compiled HLO of the 8-device run and the
sequence-parallel scaling of the 1M-token DeepSeek-V3.2 preset (MLA absorbed, DeepSeekMoE
with its experts split over the same devices), with every collective on the interconnect.
"""

import argparse
import math
import pathlib
import re

from experiments.common import add_out_argument, write_json
from experiments.costmodel.rates import (
    KERNEL_JSON,
    gpu_rates,
    kernel_calibration,
    ops_seconds,
    predict,
)
from indexer.costs import F32, Op, OpList
from model import get_config
from model.buckets import chunk_plan, length_bucket
from model.costs import attention_shape, itemsize, model_cache_bytes_per_token, prefill_counts

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
               "pred": 1, "f64": 8, "s64": 8}
_OP = re.compile(r"=\s*(.*?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls)=%([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def hlo_collectives(text):
    """{kind: bytes} summed over the collectives of compiled HLO text (result sizes per
    device; async -start/-done pairs counted once), each counted as many times as it runs:
    a collective in a while loop's body (a scan over layers, model.layer_stack) times the
    loop's known trip count. ValueError for a loop around collectives whose trip count
    XLA did not record."""
    bodies, entry, name = {}, None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(1)
            bodies[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name is not None:
            bodies[name].append(line)
    own = {}
    calls = {}  # computation -> [(callee, factor or None: unknown trip count)]
    for comp, lines in bodies.items():
        totals = dict.fromkeys(COLLECTIVES, 0)
        for line in lines:
            m = _OP.search(line)
            if m:
                for dtype, dims in _ARRAY.findall(m.group(1)):
                    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
                    totals[m.group(2)] += n * DTYPE_BYTES.get(dtype, 4)
            trip = _TRIP_COUNT.search(line)
            for kind, callee in _CALLED.findall(line):
                factor = 1
                if kind == "body":
                    factor = int(trip.group(1)) if trip else None
                calls.setdefault(comp, []).append((callee, factor))
            for group in _CALLED_LIST.findall(line):
                calls.setdefault(comp, []).extend(
                    (c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip())
        own[comp] = totals
    out = dict.fromkeys(COLLECTIVES, 0)

    def visit(comp, times):
        if comp not in own:
            return
        for kind, size in own[comp].items():
            out[kind] += size * times
        for callee, factor in calls.get(comp, ()):
            if factor is None:
                if any(own.get(callee, {}).values()):
                    raise ValueError(f"hlo_collectives: loop body {callee} holds collectives "
                                     "and XLA recorded no trip count for it")
                factor = 1
            visit(callee, times * factor)

    if entry is None:
        raise ValueError("hlo_collectives: no ENTRY computation in the HLO text")
    visit(entry, 1)
    return out


def moe_layers(config):
    return sum(config.layer_is_moe(i) for i in range(config.n_layers))


def expert_combine_bytes(config, tokens, n):
    """Bytes each device of an expert-parallel group of n sends (and receives) to combine
    the routed experts' outputs of `tokens` rows over all MoE layers: a ring all-reduce of
    [tokens, d_model] per layer, 2 (n - 1) / n x d_model x itemsize per row and MoE layer
    (an all-gather of the rows before and a reduce-scatter after, as an expert group over
    sequence-split tokens would do, moves the same)."""
    if n < 2 or config.moe is None:
        return 0.0
    return 2 * (n - 1) / n * tokens * config.d_model * itemsize(config) * moe_layers(config)


def expert_combine_op(config, tokens, n):
    """expert_combine_bytes as a "comm" Op of the "other" stage (rates.predict's comm=)."""
    return Op("other", "expert-parallel combine", "comm",
              bytes=expert_combine_bytes(config, tokens, n))


def step_collectives(config, T, sequence, tensor, *, attention=None, expert=1):
    """Predicted collectives of one prefill chunk step of T query rows: a list of dicts
    (name, kind, axis, stage, bytes = result size per device, summed over layers).
    expert: the mesh's expert axis (the routed experts split over expert x tensor)."""
    c, b = config, itemsize(config)
    a = attention or attention_shape(config)
    H, H_kv, D, Dv, kv_row = a.heads, a.kv_heads, a.qk_dim, a.v_dim, a.kv_row
    sparse = sum(c.layer_is_sparse(i) for i in range(c.n_layers))
    # Shared layers (indexer_types) run no indexer: only full layers gather keys, and only
    # those whose selection some sparse layer reads select.
    full = [i for i in range(c.n_layers) if not c.layer_is_shared(i)]
    selecting = sum(c.layer_needs_selection(i) for i in full)
    rows = []

    def add(name, kind, axis, stage, size, layers):
        if size and layers:
            rows.append(dict(name=name, kind=kind, axis=axis, stage=stage,
                             bytes=float(size * layers)))

    if sequence > 1:
        H_l, kv_l = H / tensor, H_kv / tensor if H_kv >= tensor else H_kv
        add("new indexer keys", "all-gather", "sequence", "indexer", T * c.index_dim * b,
            len(full))
        add("indexer queries + weights", "all-gather", "sequence", "indexer",
            T * c.index_heads * (c.index_dim * b + F32), selecting)
        add("selected indices", "all-gather", "sequence", "indexer", T * c.top_k * 4,
            selecting)
        add("attention queries", "all-gather", "sequence", "attention", T * H_l * D * b,
            sparse)
        add("new K/V rows (to their owner)", "all-gather", "sequence", "attention",
            T * kv_l * kv_row * b, sparse)
        add("softmax row maxima", "all-reduce", "sequence", "attention", T * H_l * F32,
            sparse)
        if T % sequence == 0:  # each shard keeps its own rows of the sums
            add("softmax partials (sum, values)", "reduce-scatter", "sequence", "attention",
                T / sequence * H_l * (Dv + 1) * F32, sparse)
        else:
            add("softmax partials (sum, values)", "all-reduce", "sequence", "attention",
                T * H_l * (Dv + 1) * F32, sparse)
        add("last position's logits", "all-reduce", "sequence", "other", c.vocab_size * F32, 1)
    if tensor > 1:
        add("attention + MLP output projections", "all-reduce", "tensor", "other",
            2 * T / sequence * c.d_model * b, c.n_layers)
    if c.moe is not None and expert * tensor > 1:
        rows_held = T / sequence if T % sequence == 0 else T
        add("expert-parallel combine", "all-reduce", "expert group", "other",
            rows_held * c.d_model * b, moe_layers(c))
    return rows


def axis_devices(axis, sizes):
    """Devices along a collective's axis; "expert group" is expert x tensor (model.moe)."""
    if axis == "expert group":
        return sizes.get("expert", 1) * sizes.get("tensor", 1)
    return sizes.get(axis, 1)


def by_kind(rows):
    out = dict.fromkeys(COLLECTIVES, 0.0)
    for r in rows:
        out[r["kind"]] += r["bytes"]
    return out


def main_model_step_bytes(config, T, sequence):
    """What rates.predict counts for one chunk: received bytes of the indexer-key
    all-gather, (S - 1) / S x T x d_I x itemsize per layer."""
    if sequence < 2:
        return 0.0
    full = sum(not config.layer_is_shared(i) for i in range(config.n_layers))
    return (sequence - 1) / sequence * T * config.index_dim * itemsize(config) * full


def wire_bytes(kind, size, n):
    """Bytes each device receives in a ring collective of result `size` over n devices:
    all-gather (n-1)/n, all-reduce 2 (n-1)/n of the result, reduce-scatter (n-1) x its
    result (a 1/n slice of the reduced array)."""
    if n < 2:
        return 0.0
    if kind == "reduce-scatter":
        return size * (n - 1)
    return size * (2 if kind == "all-reduce" else 1) * (n - 1) / n


def comm_ops(config, L, sequence, *, attention=None):
    """OpList of the interconnect traffic of a whole prefill of L tokens (sequence parallel,
    no tensor axis), per device, in the stages they delay; a MoE model's routed experts
    split over the same `sequence` devices (its combine: expert_combine_op of every row)."""
    ops = OpList()
    for ch in chunk_plan(L, start=0, capacity=length_bucket(L), chunk=config.prefill_chunk):
        for r in step_collectives(config, ch.padded, sequence, 1, attention=attention):
            ops.add(Op(r["stage"], r["name"], "comm",
                       bytes=wire_bytes(r["kind"], r["bytes"], sequence)))
    if config.moe is not None and sequence > 1:
        ops.add(expert_combine_op(config, L, sequence))
    return ops


def per_device_cache_bytes(config, L, devices, *, index_fp8=False):
    """(KV bytes split over devices, indexer keys + block summaries replicated) per device,
    summed over the layers (shared layers hold no index part)."""
    per = model_cache_bytes_per_token(config, index_fp8=index_fp8)
    return L * per["kv"] / devices, L * (per["index_keys"] + per["block_summaries"])


def scaling_rows(config, attention, length, devices, hardware, calibration):
    """TTFT and per-device cache memory of a sequence-parallel prefill per device count."""
    rows = []
    full = sum(not config.layer_is_shared(i) for i in range(config.n_layers))
    counts = {kind: prefill_counts(config, length, skip=True, indexer=kind,
                                   attention=attention) for kind in ("flat", "hierarchical")}
    for hw in hardware:
        rates = gpu_rates(hw, config.dtype, calibration)
        for n in devices:
            row = {"hardware": hw, "devices": n, "length": length}
            comm = comm_ops(config, length, n, attention=attention)
            comm_s = sum(ops_seconds(comm, rates)[0].values())
            for kind, cnt in counts.items():
                stages, _ = ops_seconds(cnt.total().scaled(1.0 / n), rates)
                compute = sum(stages.get(s, 0.0) for s in ("other", "indexer", "attention"))
                row[f"{kind}_ttft_s"] = compute + comm_s
                row[f"{kind}_main_model_ttft_s"] = predict(
                    cnt, rates, devices=n, length=length, n_layers=full,
                    index_key_bytes=config.index_dim * itemsize(config),
                    comm=[expert_combine_op(config, length, n)])["ttft_s"]
            row["comm_s"] = comm_s
            row["comm_bytes"] = sum(op.bytes for op in comm)
            kv, replicated = per_device_cache_bytes(config, length, n)
            row["kv_bytes_per_device"], row["replicated_bytes_per_device"] = kv, replicated
            row["fits"] = kv + replicated <= rates.memory_bytes
            rows.append(row)
    return rows


def devices_needed(config, attention, length, hw):
    """Fewest devices whose memory holds the 1M cache (KV split, indexer keys and summaries
    on every device; weights, activations and workspace not counted), or None."""
    mem = gpu_rates(hw, config.dtype, kernel_calibration(KERNEL_JSON)).memory_bytes
    kv, replicated = per_device_cache_bytes(config, length, 1)
    if replicated >= mem:
        return None
    return math.ceil(kv / (mem - replicated))


def check_rows(measured):
    """Predicted vs measured (compiled HLO) collective bytes of the 8-device run's steps.
    measured: the `collectives` list written by experiments.benchmarks.sharded."""
    out = []
    for m in measured:
        config = get_config(m["preset"], **m.get("overrides", {}))
        rows = step_collectives(config, m["rows"], m["sequence"], m["tensor"],
                                expert=m.get("expert", 1))
        pred = by_kind(rows)
        received = sum(wire_bytes(r["kind"], r["bytes"], axis_devices(r["axis"], m))
                       for r in rows)
        out.append({"mesh": m["mesh"], "rows": m["rows"], "measured": m["bytes"],
                    "predicted": pred, "predicted_received_bytes": received,
                    "main_model_bytes": main_model_step_bytes(config, m["rows"], m["sequence"]),
                    "measured_total": sum(m["bytes"].values()),
                    "predicted_total": sum(pred.values())})
    return out


def _gb(x):
    return f"{x / 1e9:.1f}"


def markdown(result):
    lines = ["# Sharded prefill: communication and sequence-parallel scaling", ""]
    if result["check"]:
        lines += ["## Collectives of one chunk step: predicted vs compiled (8 CPU devices)", "",
                  "| mesh | rows | compiled KB (result sizes) | predicted KB | predicted "
                  "received KB (ring) | main cost model received KB |",
                  "|---|---:|---:|---:|---:|---:|"]
        seen = set()
        for r in result["check"]:
            key = (r["mesh"], r["rows"], r["measured_total"], r["predicted_total"])
            if key in seen:  # flat and hierarchical steps exchange the same arrays
                continue
            seen.add(key)
            lines.append(f"| {r['mesh']} | {r['rows']} | {r['measured_total'] / 1e3:.1f} | "
                         f"{r['predicted_total'] / 1e3:.1f} | "
                         f"{r['predicted_received_bytes'] / 1e3:.1f} | "
                         f"{r['main_model_bytes'] / 1e3:.1f} |")
        lines += ["", "The main cost model (rates.predict) counts only the indexer-key "
                  "all-gather; the other collectives above are what it leaves out.", ""]
    s = result["setup"]
    lines += [f"## {s['config']} at {s['length']} tokens ({s['attention']})", "",
              "| GPUs | flat TTFT | hier TTFT | hier TTFT, main model | comm (s) | "
              "comm GB/device | KV GB/device | index keys + summaries GB/device | fits |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["scaling"]:
        lines.append(f"| {r['devices']}x {r['hardware']} | {r['flat_ttft_s']:.0f} s | "
                     f"{r['hierarchical_ttft_s']:.0f} s | "
                     f"{r['hierarchical_main_model_ttft_s']:.0f} s | {r['comm_s']:.1f} | "
                     f"{_gb(r['comm_bytes'])} | {_gb(r['kv_bytes_per_device'])} | "
                     f"{_gb(r['replicated_bytes_per_device'])} | {'yes' if r['fits'] else 'no'} |")
    lines += ["", "Devices a 1M-token cache needs (cache only): " + ", ".join(
        f"{hw}: {n}" for hw, n in result["devices_needed"].items()), ""]
    lines += [f"- {a}" for a in result["assumptions"]]
    return "\n".join(lines)


ASSUMPTIONS = [
    "Compute: the main cost model's counts (causal work, GPU kernel rates) divided evenly "
    "over the devices (zigzag query split); communication added on top, not overlapped.",
    "Communication per device: ring collectives over the interconnect (NVLink: A100 600, "
    "H200 900 GB/s), all-gather (S-1)/S and all-reduce 2 (S-1)/S of the result size; "
    "every collective of step_collectives, not only the indexer keys.",
    "A MoE model's routed experts are split over the same devices (expert parallel over "
    "the sequence group): every device combines every row, 2 (n-1)/n x d_model x 2 bytes "
    "per token and MoE layer ('expert-parallel combine'); the main cost model adds the "
    "same line.",
    "Memory: the latent cache split over devices, indexer keys and block summaries "
    "replicated; weights (experiments.costmodel.dsa: model.memory), activations and "
    "workspace are not counted here.",
]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.costmodel sharding",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=1048576)
    p.add_argument("--devices", default="1,2,4,8,16")
    p.add_argument("--hardware", default="a100,h200")
    p.add_argument("--measured", default=None, metavar="JSON",
                   help="results of python -m experiments.benchmarks.sharded (the compiled "
                        "collectives to check against)")
    add_out_argument(p, "costmodel_sharding")
    args = p.parse_args(argv)
    try:
        args.devices = [int(x) for x in args.devices.split(",") if x.strip()]
    except ValueError:
        p.error(f"--devices: comma-separated positive ints, got {args.devices!r}")
    if not args.devices or min(args.devices) < 1:
        p.error(f"--devices: comma-separated positive ints, got {args.devices!r}")
    args.hardware = [h.strip() for h in args.hardware.split(",") if h.strip()]
    bad = [h for h in args.hardware if h not in ("a100", "h100", "h200")]
    if bad:
        p.error(f"--hardware: unknown {bad}; choose from a100, h100, h200")
    if args.length < 1:
        p.error(f"--length must be a positive int, got {args.length}")
    return args


def main(argv=None):
    import json

    args = parse_args(argv)
    config = get_config("deepseek-v3.2")
    attention = attention_shape(config)
    calibration = kernel_calibration(KERNEL_JSON)
    check = []
    if args.measured:
        check = check_rows(json.loads(pathlib.Path(args.measured).read_text())["collectives"])
    result = {
        "setup": {"config": "deepseek-v3.2", "attention": attention.label,
                  "length": args.length, "devices": args.devices, "hardware": args.hardware},
        "check": check,
        "scaling": scaling_rows(config, attention, args.length, args.devices, args.hardware,
                                calibration),
        "devices_needed": {hw: devices_needed(config, attention, args.length, hw)
                           for hw in args.hardware},
        "assumptions": ASSUMPTIONS,
    }
    result["markdown"] = markdown(result)
    print(result["markdown"])
    out = pathlib.Path(args.out)
    write_json(out / "costmodel_sharding.json", result)
    (out / "costmodel_sharding.md").write_text(result["markdown"] + "\n")
    print(f"wrote {out / 'costmodel_sharding.json'} and {out / 'costmodel_sharding.md'}")
    return result
