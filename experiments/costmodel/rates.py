"""Rates for the cost model: seconds per FLOP, byte, top-k and sort element of each op kind.

GPUs: datasheet peaks (dense, no sparsity) times an efficiency per op kind taken from the
committed H200 kernel benchmark (results/gpu/pallas_bench_h200.json), measured at its
shortest length only, so its longer lengths stay out-of-sample for the validation. "cpu":
this machine, each op kind timed in the same run on the modeled config's shapes (the jnp
references the model runs on CPU), best of a few repeats (experiments.costmodel.cpu_rates).

Time of one op (experiments.costmodel sums them):
  FLOP kinds  GPU: max(flops / rate, bytes / bandwidth), the roofline of a kernel that
              streams its operands while it computes (gathered rows count only the share
              that misses the L2 cache); CPU: flops / rate, the rate having been timed on
              the whole op, memory traffic included;
  top-k       rows x k log2 k x topk_row + elements x topk_element (a partial sort: a
              per-row cost growing with k, plus a pass over the row);
  select      elements x select_element (scoring.threshold_topk: a fixed number of
              passes over the row; GPUs: the top-k element rate, not measured);
  sort        elements x sort_element + elements x log2(row) x sort_log;
  memory      bytes / bandwidth;   comm: bytes / interconnect bandwidth.
"""

import dataclasses
import json
import math
import pathlib

from experiments.common import REPO_ROOT
from indexer.costs import Op

FLOP_KINDS = ("matmul", "index_scores", "gathered_scores", "sparse_attention",
              "dense_attention")
KERNEL_JSON = REPO_ROOT / "results" / "gpu" / "pallas_bench_h200.json"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Datasheet figures of one device (dense tensor-core peaks, TFLOP/s; HBM TB/s and GB;
    L2 MB; interconnect GB/s per GPU)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    tf32_tflops: float
    hbm_tb_s: float
    memory_gb: float
    l2_mb: float
    link_gb_s: float
    link: str


# Datasheet peaks as published by NVIDIA (dense, no structured sparsity). float32 models run
# their matmuls as TF32 on these GPUs (XLA's default precision), so "tf32" is their peak.
HARDWARE = {
    "a100": Hardware("A100 SXM 80GB", 312.0, None, 156.0, 2.0, 80.0, 40.0, 600.0, "NVLink 3"),
    "h100": Hardware("H100 SXM", 989.0, 1979.0, 494.5, 3.35, 80.0, 50.0, 900.0, "NVLink 4"),
    "h200": Hardware("H200 SXM", 989.0, 1979.0, 494.5, 4.8, 141.0, 50.0, 900.0, "NVLink 4"),
}
HARDWARE_CHOICES = ("cpu", *HARDWARE)


@dataclasses.dataclass
class Rates:
    """flops: {kind: FLOP/s}; memory, link: bytes/s; topk_row: seconds per k log2 k per row;
    topk_element, sort_element: seconds per element; select_element: seconds per element of
    a threshold select (None: as topk_element); sort_log: seconds per element x log2(row
    length); sources: {what: where it came from}."""

    name: str
    flops: dict
    memory: float
    topk_row: float
    topk_element: float
    sort_element: float
    sort_log: float
    link: float | None = None
    memory_bytes: float | None = None
    cache_bytes: float = 0.0
    roofline: bool = True
    select_element: float | None = None
    sources: dict = dataclasses.field(default_factory=dict)

    def to_dict(self):
        return dataclasses.asdict(self)


def memory_bytes(op, rates):
    """Bytes an op moves through main memory: its streamed bytes plus the share of its
    random row reads that miss the cache, 1 - cache / source for uniformly random rows of a
    source array (all of them hit when the source fits)."""
    miss = 1.0
    if op.gather_source and rates.cache_bytes:
        miss = max(0.0, 1.0 - rates.cache_bytes / op.gather_source)
    return op.bytes + op.gather_bytes * miss


def op_seconds(op, rates):
    """Predicted seconds of one counted op (indexer.costs.Op)."""
    if op.kind in FLOP_KINDS:
        compute = op.flops / rates.flops[op.kind]
        return max(compute, memory_bytes(op, rates) / rates.memory) if rates.roofline \
            else compute
    if op.kind == "topk":
        k = max(op.k, 2)
        return op.rows * k * math.log2(k) * rates.topk_row + op.elements * rates.topk_element
    if op.kind == "select":
        per_element = rates.topk_element if rates.select_element is None else rates.select_element
        return op.elements * per_element
    if op.kind == "sort":
        return op.elements * rates.sort_element + op.sort_work * rates.sort_log
    if op.kind == "memory":
        return op.bytes / rates.memory
    if op.kind == "comm":
        return op.bytes / rates.link if rates.link else 0.0
    raise ValueError(f"unknown op kind {op.kind!r}")


# ------------------------------------------------------------------- the H200 kernel file

def repo_path(path):
    """`path` relative to the repository when inside it (no machine paths in results)."""
    try:
        return str(pathlib.Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _row(results, section, name_start, L):
    for r in results:
        if r["section"] == section and r["name"].startswith(name_start) and r["L"] == L:
            return r
    return None


def kernel_calibration(path=KERNEL_JSON):
    """Efficiencies and the top-k rate from the committed H200 kernel benchmark, at its
    shortest length L0 (longer lengths are left for validation):
      matmul            env.matmul_tflops (bf16 jnp.dot yardstick)
      index_scores      'pallas index_scores whole causal sequence' at L0 (causal pairs)
      gathered_scores   'tuning' row of gathered_index_scores with the config the run chose
      sparse_attention  'sparse_attention (pallas)' at L0;  dense: 'dense causal ... (cudnn)'
      top-k             (flat selection - whole-sequence scores) / (L0 x L0 elements): flat
                        runs lax.top_k over full rows of L0 keys for all L0 queries
    Returns a dict (TFLOP/s, seconds per element, the figures used and their rows)."""
    data = json.loads(pathlib.Path(path).read_text())
    res = data["results"]
    L0 = min(r["L"] for r in res if r["section"] == "select")
    scores = _row(res, "scores", "pallas index_scores whole", L0)
    flat = _row(res, "select", "flat", L0)
    sparse = _row(res, "attention", "sparse_attention", L0)
    dense = _row(res, "attention", "dense causal", L0)
    chosen = data.get("tuned", {}).get("gathered_index_scores")
    gathered = [t for t in data.get("tuning", []) if t["kernel"] == "gathered_index_scores"]
    pick = [t for t in gathered if t["config"] == chosen] or gathered
    gathered_tflops = max(t["tflops"] for t in pick)
    topk = (flat["time_s"] - scores["time_s"]) / (L0 * L0)
    return {"device": data["env"]["device_kind"], "jax": data["env"]["jax"],
            "calibration_length": L0,
            "tflops": {"matmul": data["env"]["matmul_tflops"], "index_scores": scores["tflops"],
                       "gathered_scores": gathered_tflops, "sparse_attention": sparse["tflops"],
                       "dense_attention": dense["tflops"]},
            "topk_element_s": topk, "measured_peak_tflops": HARDWARE["h200"].bf16_tflops,
            "measured_hbm_tb_s": HARDWARE["h200"].hbm_tb_s,
            "source": repo_path(path)}


def gpu_rates(key, dtype, calibration):
    """Rates of one GPU: its peak for `dtype` (bf16, or TF32 for float32) times the H200's
    measured fraction of the H200 peak per kind; HBM at datasheet bandwidth (no committed
    measurement is bandwidth-bound); top-k and sort per element scaled from the H200 by the
    HBM bandwidth ratio (XLA's GPU top-k with large k is a sort, memory-bound)."""
    hw = HARDWARE[key]
    peak = hw.bf16_tflops if dtype == "bfloat16" else hw.tf32_tflops
    base = calibration["measured_peak_tflops"]
    flops = {k: peak * 1e12 * v / base for k, v in calibration["tflops"].items()}
    per_el = calibration["topk_element_s"] * calibration["measured_hbm_tb_s"] / hw.hbm_tb_s
    src = (f"{calibration['source']} ({calibration['device']}, jax {calibration['jax']}, "
           f"L={calibration['calibration_length']})")
    sources = {k: f"{v:.0f} TFLOP/s measured on the H200 = {v / base:.3f} of its bf16 peak; "
               f"{src}" for k, v in calibration["tflops"].items()}
    sources["topk"] = (f"{1 / calibration['topk_element_s']:.3g} elements/s on the H200 "
                       f"(flat selection minus its scores), x {hw.hbm_tb_s} / "
                       f"{calibration['measured_hbm_tb_s']} TB/s; {src}")
    sources["sort"] = "as top-k per element (XLA's GPU sort); not measured"
    sources["select"] = "as top-k per element (a threshold select's passes); not measured"
    sources["memory"] = (f"{hw.hbm_tb_s} TB/s datasheet, efficiency 1.0 (not measured); "
                         f"random row gathers from arrays within its {hw.l2_mb:.0f} MB L2 hit")
    sources["peak"] = f"{peak} TFLOP/s datasheet ({'bf16' if dtype == 'bfloat16' else 'tf32'})"
    return Rates(hw.name, flops, hw.hbm_tb_s * 1e12, 0.0, per_el, per_el, 0.0,
                 link=hw.link_gb_s * 1e9, memory_bytes=hw.memory_gb * 1e9,
                 cache_bytes=hw.l2_mb * 1e6, sources=sources)


# ------------------------------------------------------------------------- predictions

STAGE_RULE = ("each op takes max(compute time, memory time) on a GPU, the roofline of a "
              "kernel that streams its operands while it computes, and its measured rate on "
              "CPU (timed on the whole op, memory traffic included); top-k and sort take "
              "their own measured rates; ops and stages add up, because they run one after "
              "another, each consuming the previous one's output (neither XLA nor the "
              "kernels overlap them)")


def ops_seconds(ops, rates):
    """{stage: seconds} and [(stage, name, seconds)] of an OpList."""
    stages, detail = {}, []
    for op in ops:
        t = op_seconds(op, rates)
        stages[op.stage] = stages.get(op.stage, 0.0) + t
        detail.append((op.stage, op.name, t))
    return stages, detail


def predict(counts, rates, *, devices=1, index_key_bytes=0.0, length=0, n_layers=0, comm=()):
    """Predicted prefill from counts (model.costs.PrefillCounts): per-stage seconds,
    TTFT (other + indexer + attention), the split and the indexer share. devices > 1:
    sequence parallel with balanced work (each device does 1 / devices of every op) plus
    an all-gather of the indexer keys per layer over the interconnect ((devices - 1) /
    devices x length x index_key_bytes received per layer; n_layers: the layers that cache
    index keys), counted in the indexer stage. comm: more "comm" Ops, bytes per device
    (e.g. experiments.costmodel.sharding.expert_combine_op), added as they are."""
    ops = counts.total()
    if devices > 1:
        ops = ops.scaled(1.0 / devices)
        ops.add(Op("indexer", "all-gather indexer keys", "comm",
                   bytes=(devices - 1) / devices * length * index_key_bytes * n_layers))
    ops.extend(comm)
    stages, detail = ops_seconds(ops, rates)
    ttft = sum(stages.get(s, 0.0) for s in ("other", "indexer", "attention"))
    dense = stages.get("other", 0.0) + stages.get("dense_attention", 0.0)
    return {"stages_s": {s: stages.get(s, 0.0) for s in ("other", "indexer", "attention")},
            "ttft_s": ttft, "dense_ttft_s": dense,
            "split": {s: stages.get(s, 0.0) / ttft for s in ("other", "indexer", "attention")},
            "indexer_share": stages.get("indexer", 0.0) / ttft,
            "ops_s": [{"stage": s, "op": n, "seconds": t} for s, n, t in detail]}
