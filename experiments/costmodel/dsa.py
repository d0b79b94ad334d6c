"""DeepSeek-V3.2 and GLM-5 in the cost model, with their real architectures (the full-size
presets of model.dsa_presets: MLA absorbed over the latent cache, DeepSeekMoE, their own
indexers; GLM-5 also with a shared-layer schedule): flat vs hierarchical TTFT at 128K-1M
tokens on 8 x H200 and 8 x H100, parameters (total and active), cache bytes per token
(indexer keys in bf16 or FP8), weights per device as model.memory counts them over a mesh,
and the longest context 8 H200 hold.

Two deployments of 8 GPUs:
  sequence=8 + EP  every device prefills 1/8 of the queries (balanced causal work) and
                   holds 1/8 of the latent cache; the routed experts split over the same 8
                   devices (weights: model.memory over {"expert": 8}); per MoE layer each
                   device combines every row of the chunk (sharding.expert_combine_op);
  tensor=8         dosa's mesh today for a model this size (sequence and expert are
                   separate mesh axes, and the experts need all 8 devices): attention heads
                   and experts split 8 ways, the selection replicated (every device scores
                   every pair), the cache whole on each device.
"""

import dataclasses

from experiments.costmodel.rates import gpu_rates, ops_seconds, predict
from experiments.costmodel.sharding import expert_combine_op, moe_layers
from indexer.costs import Op, OpList
from model import get_config
from model.costs import (
    cache_bytes_per_token,
    itemsize,
    max_context,
    model_cache_bytes_per_token,
    parameter_count,
    prefill_counts,
)
from model.dsa_presets import GLM5_SHARED_SCHEDULE

MODELS = (("DeepSeek-V3.2", "deepseek-v3.2", {}),
          ("GLM-5", "glm-5", {}),
          ("GLM-5, shared 1 in 4", "glm-5", {"indexer_types": GLM5_SHARED_SCHEDULE}))
LENGTHS = (131072, 262144, 524288, 1048576)
SETUPS = (("h200", 8), ("h100", 8))
STAGES = ("other", "indexer", "attention")


def models(names=None):
    """[(label, ModelConfig)] of MODELS (names: a subset of their labels)."""
    return [(label, get_config(preset, **overrides)) for label, preset, overrides in MODELS
            if names is None or label in names]


def full_layers(config):
    return sum(not config.layer_is_shared(i) for i in range(config.n_layers))


def tensor_parallel_ttft(counts, rates, config, L, n):
    """TTFT on mesh tensor=n: "other" and "attention" split n ways (heads, MLP hidden and
    experts over the group; the few replicated projections are not singled out), the
    selection whole on each device; the expert group's psum of every row per MoE layer and
    tensor all-reduces of the attention and MLP outputs per layer (2 (n-1)/n each)."""
    stages, _ = ops_seconds(counts.total(), rates)
    b, D = itemsize(config), config.d_model
    comm = OpList([expert_combine_op(config, L, n),
                   Op("other", "tensor all-reduces", "comm",
                      bytes=2 * 2 * (n - 1) / n * L * D * b * config.n_layers)])
    comm_s = sum(ops_seconds(comm, rates)[0].values())
    return (stages.get("other", 0.0) + stages.get("attention", 0.0)) / n \
        + stages.get("indexer", 0.0) + comm_s


def ttft_rows(calibration, model_list=None, lengths=LENGTHS, setups=SETUPS):
    """Flat vs hierarchical TTFT per model, hardware and length (sequence=8 + EP, and the
    tensor=8 TTFTs beside them)."""
    rows = []
    for label, config in model_list or models():
        for hw, n in setups:
            rates = gpu_rates(hw, config.dtype, calibration)
            for L in lengths:
                row = {"model": label, "hardware": hw, "devices": n, "length": L}
                for kind in ("flat", "hierarchical"):
                    counts = prefill_counts(config, L, skip=True, indexer=kind)
                    # every layer's new index keys (or entries) gathered, summed per token
                    p = predict(counts, rates, devices=n, length=L, n_layers=1,
                                index_key_bytes=model_cache_bytes_per_token(config)["index_keys"],
                                comm=[expert_combine_op(config, L, n)])
                    row[f"{kind}_ttft_s"] = p["ttft_s"]
                    row[f"indexer_share_{kind}"] = p["indexer_share"]
                    row[f"split_{kind}"] = p["split"]
                    row[f"expert_combine_s_{kind}"] = sum(
                        o["seconds"] for o in p["ops_s"] if o["op"] == "expert-parallel combine")
                    row[f"tensor_{kind}_ttft_s"] = tensor_parallel_ttft(counts, rates, config,
                                                                        L, n)
                row["ttft_ratio"] = row["flat_ttft_s"] / row["hierarchical_ttft_s"]
                row["tensor_ttft_ratio"] = (row["tensor_flat_ttft_s"]
                                            / row["tensor_hierarchical_ttft_s"])
                row["expert_combine_s"] = row.pop("expert_combine_s_flat")
                row.pop("expert_combine_s_hierarchical")
                rows.append(row)
    return rows


def _weights(config, mesh):
    from model.memory import param_bytes_per_device

    return param_bytes_per_device(config, mesh)[0]


def expert_mesh():
    """The mesh that splits the routed experts alone over 8 devices, if model.sharding has
    the axis (else None)."""
    from model.sharding import MESH_AXES

    return {"expert": 8} if "expert" in MESH_AXES else None


def capacity(label, config, memory_bytes, devices=8):
    """Parameters, cache bytes per token and what `devices` devices of memory_bytes hold."""
    per_layer = {fp8: cache_bytes_per_token(config, index_fp8=fp8) for fp8 in (False, True)}
    summed = {fp8: model_cache_bytes_per_token(config, index_fp8=fp8) for fp8 in (False, True)}
    out = {"model": label, "parameters": parameter_count(config),
           "active_parameters": parameter_count(config, active=True),
           "active_parameters_no_embedding": parameter_count(config, active=True,
                                                             embeddings=False),
           "full_layers": full_layers(config), "moe_layers": moe_layers(config),
           "latent_bytes_per_token_per_layer": per_layer[False]["kv"],
           "index_key_bytes": {"bf16": per_layer[False]["index_keys"],
                               "fp8": per_layer[True]["index_keys"]},
           "bytes_per_token_per_layer": {
               "bf16": per_layer[False]["kv"] + per_layer[False]["index_keys"],
               "fp8_index_keys": per_layer[True]["kv"] + per_layer[True]["index_keys"]},
           "block_summary_bytes_per_token_per_layer": per_layer[False]["block_summaries"],
           "bytes_per_token": {"bf16": sum(summed[False].values()),
                               "fp8_index_keys": sum(summed[True].values())},
           "meshes": []}
    meshes = [("tensor=8", {"tensor": devices}, 1)]
    ep = expert_mesh()
    if ep is not None:
        meshes.insert(0, ("sequence=8 + EP (expert=8)", {"expert": devices}, devices))
    fp8_experts = {}
    if "fp8_block" in {f.name for f in dataclasses.fields(type(config.moe))}:
        fp8_experts = {"fp8 experts": config.replace(moe=config.moe.replace(
            fp8_block=(128, 128)))}
    for name, mesh, cache_split in meshes:
        for what, cfg in {"bf16 experts": config, **fp8_experts}.items():
            weights = _weights(cfg, mesh)
            out["meshes"].append({
                "mesh": name, "experts": what, "weights_per_device": weights,
                "max_context": {key: max_context(memory_bytes, weights, summed[fp8], 1,
                                                 devices=cache_split)
                                for key, fp8 in (("bf16", False), ("fp8_index_keys", True))}})
    return out


def capacity_rows(memory_bytes, model_list=None):
    return [capacity(label, config, memory_bytes)
            for label, config in (model_list or models())[:2]]  # the shared GLM: same weights


def _s(x):
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def markdown(result):
    lines = ["## DeepSeek-V3.2 and GLM-5, real architectures", "",
             "| model | GPUs | L | flat TTFT s | hier TTFT s | flat / hier | indexer share "
             "flat | hier | EP combine s | tensor=8: flat s | hier s | flat / hier |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['devices']}x {r['hardware'].upper()} | {r['length'] // 1024}K "
            f"| {_s(r['flat_ttft_s'])} | {_s(r['hierarchical_ttft_s'])} | "
            f"{r['ttft_ratio']:.2f}x | {r['indexer_share_flat']:.0%} | "
            f"{r['indexer_share_hierarchical']:.0%} | {r['expert_combine_s']:.2f} | "
            f"{_s(r['tensor_flat_ttft_s'])} | {_s(r['tensor_hierarchical_ttft_s'])} | "
            f"{r['tensor_ttft_ratio']:.2f}x |")
    lines += ["", "| model | parameters | active (without the embedding table) | latent B "
              "per token and layer | index key bf16 / FP8 | per token and layer bf16 / FP8 "
              "keys | per token, all layers (with summaries) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for c in result["capacity"]:
        b, t = c["bytes_per_token_per_layer"], c["bytes_per_token"]
        active = c["active_parameters"] / 1e9, c["active_parameters_no_embedding"] / 1e9
        lines.append(
            f"| {c['model']} | {c['parameters'] / 1e9:.1f}B | {active[0]:.1f}B "
            f"({active[1]:.1f}B) | {c['latent_bytes_per_token_per_layer']} | "
            f"{c['index_key_bytes']['bf16']} / {c['index_key_bytes']['fp8']} | "
            f"{b['bf16']} / {b['fp8_index_keys']} | {t['bf16']:,.0f} / "
            f"{t['fp8_index_keys']:,.0f} |")
    lines += ["", f"Weights per device (model.memory.param_bytes_per_device) and the longest "
              f"context on 8 GPUs of {result['memory_bytes'] / 1e9:.0f} GB:", "",
              "| model | mesh | experts | weights GB per device | longest context, bf16 / "
              "FP8 index keys |", "|---|---|---|---:|---:|"]
    for c in result["capacity"]:
        for m in c["meshes"]:
            ctx = m["max_context"]
            fits = " / ".join(f"{v:,}" if v else "does not fit" for v in ctx.values())
            lines.append(f"| {c['model']} | {m['mesh']} | {m['experts']} | "
                         f"{m['weights_per_device'] / 1e9:.1f} | {fits} |")
    lines += [""] + [f"- {a}" for a in result["assumptions"]]
    return "\n".join(lines)


def assumptions(calibration, model_list=None):
    configs = dict(model_list or models())
    v32 = configs.get("DeepSeek-V3.2") or next(iter(configs.values()))
    h, m = v32.hierarchical, v32.mla
    shared = configs.get("GLM-5, shared 1 in 4")
    return [
        f"Shapes: the full-size presets deepseek-v3.2 and glm-5 (model/dsa_presets.py names "
        f"each value's source), bf16, prefill chunks of {v32.prefill_chunk} with the runner's "
        f"power-of-two key buckets; every layer sparse, top_k {v32.top_k}; hierarchical: "
        f"blocks of {h.block_size}, {h.candidate_tokens} candidate tokens per query, tiles of "
        f"{h.query_tile} queries." + (f" 'GLM-5, shared 1 in 4': indexer_types "
                                       f"{GLM5_SHARED_SCHEDULE} ({full_layers(shared)} of "
                                       f"{shared.n_layers} layers run an indexer)."
                                       if shared else ""),
        f"Counted as dosa runs them (model.costs): MLA absorbed (q_a, q_b, kv_a, kv_b, o: 2 "
        f"FLOPs per parameter and token, kv_b folded into the queries and the output), "
        f"attention in MQA form over the latent: one {m.latent_dim}-value row per selected "
        f"token read once for all heads, 2 x heads x ({m.latent_dim} + {m.kv_lora_rank}) "
        f"FLOPs per (query, selected token); the latent cache (kv_lora_rank + "
        f"qk_rope_head_dim values per token and layer); DeepSeekMoE: float32 router, "
        f"top-k choice, assignments sorted by expert, the num_experts_per_tok routed experts "
        f"per token through ragged_dot (counted at the bf16 matmul rate: not measured), the "
        f"weights of every expert a chunk routes to read once per chunk, gathers and the "
        f"weighted scatter-back, the shared experts on every token; the first layers dense "
        f"(mlp_layer_types); the indexer's wq_b from the q-LoRA residual.",
        "sequence=8 + EP: every op split evenly over the 8 devices (zigzag query split for "
        "the causal work; the routed experts' work and weight reads split 8 ways), plus "
        "two interconnect lines not overlapped with compute: the all-gather of the new "
        "indexer keys per full layer (d_I x 2 bytes per token; V3.2's FP8 keys would be "
        "132 of 256 bytes) and the expert-parallel combine (EP combine s): 2 (n-1)/n x "
        "d_model x 2 bytes per token and MoE layer, every row of every chunk (the psum of "
        "model.moe, or an all-gather before and a reduce-scatter after the experts). "
        "Attention's own exchanges (queries, K/V rows, softmax partials) are in "
        "`python -m experiments.costmodel sharding`, not here.",
        "tensor=8 (dosa's mesh today for these weights): 'other' and attention split 8 "
        "ways, the selection (indexer stage) on every device whole, plus the expert group's "
        "psum of every row per MoE layer and two tensor all-reduces (attention and MLP "
        "outputs) per layer; the replicated small projections (q_a, kv_a, the indexer's) "
        "are not singled out.",
        f"Rates: datasheet bf16 peaks (H100 and H200 989 TFLOP/s; HBM H100 3.35, H200 4.8 "
        f"TB/s; NVLink 900 GB/s) x the fraction of peak each kernel reached on the H200 at "
        f"{calibration['calibration_length']} tokens (results/gpu/pallas_bench_h200.json), "
        f"H100 efficiencies assumed equal; top-k per element scaled by HBM bandwidth; sparse "
        f"attention at the efficiency the H200 kernel reached with 16 heads per kv head "
        f"(pessimistic for MQA over a 576-value latent shared by 64-128 heads).",
        "Weights per device: model.memory.param_bytes_per_device over the mesh, i.e. the "
        "parameters as dosa stores them (ModelConfig.param_dtype: bf16, as the checkpoint "
        "loads; norms and routers float32; routed experts FP8 e4m3 + block scales with "
        "MoEConfig.fp8_block); "
        "'expert=8' splits the routed experts 8 ways and keeps the rest whole on every "
        "device. Longest context: the GPU's memory minus the weights, the latent cache "
        "split over the sequence devices (8 with EP, 1 on tensor=8), indexer keys and "
        "block summaries whole on every device; activations and workspace not counted.",
        "TTFT = other + indexer + attention (+ the interconnect lines) of the slowest "
        "(here: every) device; compile time, launch gaps and host overheads not modeled.",
    ]


def dsa_result(calibration, memory_bytes):
    """The section of costmodel.json: rows, capacity, assumptions, and its markdown."""
    model_list = models()
    result = {"rows": ttft_rows(calibration, model_list),
              "capacity": capacity_rows(memory_bytes, model_list),
              "memory_bytes": memory_bytes, "assumptions": assumptions(calibration, model_list)}
    result["markdown"] = markdown(result)
    return result
