"""experiments.costmodel: counts by hand for the tiny preset, scaling, caches, capacity, rates
from the committed H200 file, the CLI. No timing here (the CPU calibration is a slow test)."""

import dataclasses
import json

import jax
import pytest
from flax import nnx

from experiments.costmodel import cli as costmodel
from experiments.costmodel.dsa import capacity, models, ttft_rows
from experiments.costmodel.rates import (
    gpu_rates,
    kernel_calibration,
    op_seconds,
    ops_seconds,
    predict,
)
from experiments.costmodel.sharding import expert_combine_bytes, step_collectives
from experiments.costmodel.validate import (
    cpu_frontier_rows,
    frontier_model_config,
    h200_rows,
    ratio_rows,
)
from indexer.costs import Op, OpList, hierarchical_sizes, visible_blocks, visible_keys
from model import Transformer, get_config
from model.buckets import chunk_plan
from model.costs import (
    cache_bytes_per_token,
    max_context,
    parameter_count,
    prefill_counts,
)

TINY = get_config("tiny")  # d 64, 2 layers, H 4 / H_kv 2 x 16, d_ff 128, H_I 2 x 16, top_k 16


def test_runner_chunks_of_tiny_at_256():
    # 256 tokens in chunks of 64; every chunk reads the minimum bucket of 256 keys.
    chunks = chunk_plan(256, start=0, capacity=256, chunk=TINY.prefill_chunk)
    assert [(c.padded, c.position, c.kv_len) for c in chunks] == [
        (64, 0, 256), (64, 64, 256), (64, 128, 256), (64, 192, 256)]
    # A ragged end: the last chunk (232 tokens) is padded to its power-of-two bucket; keys
    # up to the bucket of each chunk's end.
    assert [(c.padded, c.position, c.kv_len)
            for c in chunk_plan(1000, start=0, capacity=1024, chunk=384)] == [
        (384, 0, 512), (384, 384, 1024), (256, 768, 1024)]


def test_visible_sums_match_loops():
    for p0, T, cap in ((0, 256, 256), (100, 37, 50), (5, 3, 1000)):
        assert visible_keys(p0, T, cap) == sum(min(cap, p + 1) for p in range(p0, p0 + T))
    for p0, T, cap, B in ((0, 256, 32, 8), (0, 256, 16, 8), (70, 45, 6, 8), (3, 9, 100, 4)):
        assert visible_blocks(p0, T, cap, B) == sum(min(cap, p // B + 1)
                                                    for p in range(p0, p0 + T))


def test_flat_layer_counts_by_hand():
    per_layer = prefill_counts(TINY, 256, skip=True, indexer="flat").per_layer["flat"].totals()
    # Indexer: 2 * H_I * d_I = 64 FLOPs per causal pair, 256 * 257 / 2 = 32896 pairs.
    assert per_layer["indexer"]["flops"] == 2 * 2 * 16 * 32896 == 2_105_344
    # Sparse attention: 2 * 2 * H * D = 256 FLOPs per selected token; a query at position p
    # selects min(16, p + 1): 1 + ... + 16 + 240 * 16 = 3976 tokens.
    assert per_layer["attention"]["flops"] == 2 * 2 * 4 * 16 * 3976 == 1_017_856
    # Attention bytes: gathered K and V rows (H_kv 2 x 2 x 16 f32 = 256 B per token) +
    # q and out (4 x (16 + 16) f32 per query) + indices (16 int32 per query).
    assert per_layer["attention"]["bytes"] == 3976 * 256 + 256 * (4 * 32 * 4 + 16 * 4)
    # Other: 2 x parameters x tokens; attention 64 * (4 + 2 + 2) * 16 + 64 * 64 = 12288,
    # indexer 64 * (2 * 16 + 16 + 2) = 3200, MLP 3 * 64 * 128 = 24576.
    assert per_layer["other"]["flops"] == 2 * (12288 + 3200 + 24576) * 256 == 20_512_768
    # Dense attention for comparison: the causal pairs at 2 * 2 * H * D each.
    assert per_layer["dense_attention"]["flops"] == 256 * 32896
    # On CPU (jnp references) every masked pair is computed: 4 chunks x 64 x 256 keys.
    cpu = prefill_counts(TINY, 256, skip=False, indexer="flat").per_layer["flat"].totals()
    assert cpu["indexer"]["flops"] == 64 * 4 * 64 * 256


def test_flat_score_and_cache_bytes_by_hand():
    ops = {op.name: op for op in prefill_counts(TINY, 256, skip=True, indexer="flat")
           .per_layer["flat"]}
    # Per chunk: q (64 x 2 x 16 f32) + w (64 x 2 f32) + keys (256 x 16 f32, one query tile of
    # 64) + scores written (64 x 256 f32); 4 chunks.
    assert ops["flat scores"].bytes == 4 * (64 * 2 * (16 * 4 + 4) + 256 * 16 * 4 + 64 * 256 * 4)
    top_k = ops["flat top_k"]
    assert (top_k.rows, top_k.elements, top_k.k) == (256, 256 * 256, 16)
    # Cache writes per token: K and V (2 x 2 x 16 f32) and the indexer key (16 f32), plus
    # the block-summary update (sum, min, max, count: 4 f32 per key value) and its read.
    assert ops["cache writes"].bytes == 256 * ((64 + 16) * 4 + 16 * (4 * 4 + 4))
    # The MLP reads its weights once per chunk.
    assert ops["mlp"].bytes == 4 * (3 * 64 * 128 * 4 + 64 * (64 + 3 * 128) * 4)


def test_hierarchical_layer_counts_by_hand():
    # Blocks of 8: 32 blocks; 32 candidate tokens = 4 blocks per query; tiles of 4 queries
    # share 128 tokens = 16 blocks; each query ranks its own 4 blocks.
    assert hierarchical_sizes(TINY.hierarchical, 64, 256, TINY.top_k,
                              TINY.index_heads) == (4, 32, 4, 16, True)
    counts = prefill_counts(TINY, 256, skip=True, indexer="hierarchical")
    ops = {op.name: op for op in counts.per_layer["hierarchical"]}
    # Coarse: a query at p sees p // 8 + 1 blocks: 8 * (1 + ... + 32) = 4224 pairs.
    assert ops["coarse scores"].flops == 2 * 2 * 16 * 4224
    # Fine: min(16, p // 8 + 1) blocks of 8 tokens: 8 * (8 * (1 + ... + 16) + 128 * 16).
    assert ops["fine scores"].flops == 2 * 2 * 16 * 8 * (8 * 136 + 128 * 16)
    # Spread priority (1 bound block): a [H_I, d_I] x [d_I, H_I] product per query.
    assert ops["spread priority"].flops == 2 * 2 * 2 * 16 * 256
    # Ranking: fast ranking selects over each query's 4 x 8 = 32 candidate columns.
    assert ops["rank"].kind == "select" and ops["rank"].elements == 256 * 32
    total = counts.per_layer["hierarchical"].totals()["indexer"]["flops"]
    assert total == 270_336 + 1_605_632 + 32_768


def test_fast_ranking_is_priced_as_a_threshold_select():
    from indexer.config import HierarchicalConfig
    from indexer.costs import Selection, hierarchical_ops

    def rank(**fields):
        config = HierarchicalConfig(block_size=64, candidate_tokens=8192,
                                    tile_candidate_tokens=8192, **fields)
        ops = hierarchical_ops(Selection("hierarchical", 4, 64, 1024, 2, config), 512,
                               32768 - 512, 32768, False)
        return {op.name: op for op in ops}["rank"]

    fast, exact = rank(fast_ranking=True), rank(fast_ranking=False)
    assert (fast.kind, exact.kind) == ("select", "topk")
    assert fast.elements == exact.elements == 512 * 8192
    rates = gpu_rates("h200", "bfloat16", kernel_calibration())
    assert rates.select_element is None  # not measured on a GPU: the top-k element rate
    assert op_seconds(fast, rates) == pytest.approx(512 * 8192 * rates.topk_element)
    cpu = dataclasses.replace(rates, select_element=rates.topk_element / 4)
    assert op_seconds(fast, cpu) == pytest.approx(op_seconds(fast, rates) / 4)


def test_parameter_count_matches_the_model():
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert parameter_count(TINY) == params


def test_scaling_flat_quadratic_hierarchical_near_linear():
    small = get_config("small")

    def indexer_flops(kind, L):
        return prefill_counts(small, L, skip=True, indexer=kind).total().totals()[
            "indexer"]["flops"]

    flat = indexer_flops("flat", 65536) / indexer_flops("flat", 32768)
    hier = indexer_flops("hierarchical", 65536) / indexer_flops("hierarchical", 32768)
    assert flat == pytest.approx(4.0, rel=0.01)
    # The fine stage is a fixed table per query; only the coarse stage (1 / 64 of flat's
    # pairs) still grows with the context.
    assert 2.0 <= hier <= 2.5


def test_cache_bytes_and_capacity_of_tiny():
    per_token = cache_bytes_per_token(TINY)
    # K and V: 2 kv heads x 16 x 2 f32; indexer key: 16 f32; summaries: (3 x 16 + 2) f32
    # per block of 8 tokens.
    assert per_token == {"kv": 256, "index_keys": 64, "block_summaries": 25.0}
    # One device: (memory - weights) / (layers x all caches) = 9e8 / (2 x 345).
    assert max_context(1e9, 1e8, per_token, 2) == 1_304_347
    # Four devices: KV split over them, indexer keys and summaries on each.
    assert max_context(1e9, 1e8, per_token, 2, devices=4) == int(9e8 // (2 * (64 + 64 + 25)))
    assert max_context(1e9, 2e9, per_token, 2) == 0  # the weights alone do not fit


def test_op_time_is_a_roofline_and_topk_its_own_rate():
    rates = gpu_rates("h200", "bfloat16", kernel_calibration())
    mm = rates.flops["matmul"]
    compute = Op("other", "x", "matmul", flops=mm, bytes=1.0)
    memory = Op("other", "x", "matmul", flops=1.0, bytes=2 * rates.memory)
    assert op_seconds(compute, rates) == pytest.approx(1.0)
    assert op_seconds(memory, rates) == pytest.approx(2.0)
    topk = Op("indexer", "t", "topk", rows=10, elements=1000, k=16)
    assert op_seconds(topk, rates) == pytest.approx(1000 * rates.topk_element)
    # Gathers from an array that fits the 50 MB L2 cost no HBM traffic; a 100 MB one half.
    hit = Op("attention", "a", "sparse_attention", flops=1.0, gather_bytes=rates.memory,
             gather_source=25e6)
    half = Op("attention", "a", "sparse_attention", flops=1.0, gather_bytes=rates.memory,
              gather_source=100e6)
    assert op_seconds(hit, rates) == pytest.approx(1.0 / rates.flops["sparse_attention"])
    assert op_seconds(half, rates) == pytest.approx(0.5)


def test_kernel_calibration_reads_the_committed_h200_file():
    cal = kernel_calibration()
    assert cal["calibration_length"] == 32768
    assert cal["tflops"]["matmul"] == pytest.approx(701.3, rel=1e-3)
    assert cal["tflops"]["index_scores"] == pytest.approx(533.7, rel=1e-3)
    # top-k: (flat 83.3 ms - scores 16.5 ms) over 32768 x 32768 elements.
    assert cal["topk_element_s"] == pytest.approx((0.083345 - 0.016482) / 32768 ** 2, rel=1e-3)
    a100 = gpu_rates("a100", "bfloat16", cal)
    h200 = gpu_rates("h200", "bfloat16", cal)
    assert a100.flops["matmul"] / h200.flops["matmul"] == pytest.approx(312 / 989)
    assert a100.topk_element / h200.topk_element == pytest.approx(4.8 / 2.0)


def test_h200_points_reproduced():
    rows = h200_rows(kernel_calibration(), costmodel.KERNEL_JSON)
    fitted = [r for r in rows if r["note"] == "calibration point"]
    assert fitted and all(abs(r["error"]) < 0.01 for r in fitted)
    held_out = [r for r in rows if r["note"] != "calibration point"]
    assert len(held_out) == 11
    assert all(abs(r["error"]) < 0.3 for r in held_out)


def test_ratio_rows_pair_flat_with_each_hierarchical_variant():
    def row(what, predicted, measured):
        return {"where": "cpu", "what": what, "length": 8, "predicted_s": predicted,
                "measured_s": measured, "note": ""}

    rows = [row("prefill flat", 4.0, 2.0), row("prefill hierarchical", 2.0, 1.0),
            row("prefill hierarchical:0", 1.0, 2.0), row("dense attention", 1.0, 1.0)]
    got = {r["what"]: (r["predicted"], r["measured"], r["error"]) for r in ratio_rows(rows)}
    assert got == {"prefill flat / hierarchical": (2.0, 2.0, 0.0),
                   "prefill flat / hierarchical:0": (4.0, 1.0, 3.0)}


def test_frontier_rows_price_each_recorded_config_against_flat(tmp_path):
    from indexer.config import HierarchicalConfig
    from indexer.costs import Selection, flat_ops, hierarchical_ops

    wide = HierarchicalConfig(block_size=8, candidate_tokens=64, fast_ranking=True)
    rows = [{"name": "streaming/256", "hierarchical_s": 3.0},  # no config: not priced
            {"name": "mean/fixed/64", "hierarchical_s": 0.5, "config": wide.to_dict()},
            {"name": "mean/fixed/32@freq2", "hierarchical_s": 0.2, "reuse": "freq2",
             "config": wide.to_dict()}]  # a reuse row runs fewer layers: not priced
    data = {"queries": 32, "layers": 2, "top_k": 16, "indexer": "x",
            "lengths": [{"length": 256, "flat_s": 2.0, "rows": rows}]}
    path = tmp_path / "frontier.json"
    path.write_text(json.dumps(data))
    rates = gpu_rates("h200", TINY.dtype, kernel_calibration())
    got = cpu_frontier_rows(rates, TINY, path)
    assert [r["measured_s"] for r in got] == [2.0, 0.5]
    H, d = TINY.index_heads, TINY.index_dim
    flat = 2 * ops_seconds(OpList(flat_ops(Selection("flat", H, d, 16, 4), 32, 224, 256,
                                           False)), rates)[0]["indexer"]
    hier = 2 * ops_seconds(OpList(hierarchical_ops(
        Selection("hierarchical", H, d, 16, 4, wide), 32, 224, 256, False)),
        rates)[0]["indexer"]
    assert [r["predicted_s"] for r in got] == pytest.approx([flat, hier])
    (ratio,) = ratio_rows(got)
    assert ratio["predicted"] == pytest.approx(flat / hier) and ratio["measured"] == 4.0
    # A frontier that records no configs (before 2026-12-05) gives no rows.
    data["lengths"][0]["rows"] = rows[:1]
    path.write_text(json.dumps(data))
    assert frontier_model_config(path) is None


def test_predict_splits_and_sequence_parallel():
    small = get_config("small")
    rates = gpu_rates("h200", small.dtype, kernel_calibration())
    counts = prefill_counts(small, 16384, skip=True)
    one = predict(counts, rates)
    assert sum(one["split"].values()) == pytest.approx(1.0)
    assert one["indexer_share"] == one["split"]["indexer"]
    four = predict(counts, rates, devices=4, length=16384, index_key_bytes=256, n_layers=4)
    gather = [o for o in four["ops_s"] if o["op"] == "all-gather indexer keys"][0]
    assert gather["seconds"] == pytest.approx(0.75 * 16384 * 256 * 4 / 900e9)
    assert four["stages_s"]["other"] == pytest.approx(one["stages_s"]["other"] / 4)


def test_dsa_table_rows():
    rows = ttft_rows(kernel_calibration(), lengths=(131072,),
                     setups=(("h200", 8), ("h100", 8)))
    assert [(r["model"], r["hardware"]) for r in rows] == [
        (m, hw) for m in ("DeepSeek-V3.2", "GLM-5", "GLM-5, shared 1 in 4")
        for hw in ("h200", "h100")]
    for r in rows:
        assert r["ttft_ratio"] == pytest.approx(r["flat_ttft_s"] / r["hierarchical_ttft_s"])
        assert r["indexer_share_flat"] > r["indexer_share_hierarchical"]
        # The selection is not split on tensor=8: slower than 8 sequence shards.
        assert r["tensor_flat_ttft_s"] > r["flat_ttft_s"]
        assert r["expert_combine_s"] > 0
    by = {(r["model"], r["hardware"]): r for r in rows}
    # Same compute peak, less bandwidth: the H100 is slower; shared layers run fewer indexers.
    assert by["DeepSeek-V3.2", "h100"]["flat_ttft_s"] > by["DeepSeek-V3.2", "h200"]["flat_ttft_s"]
    assert (by["GLM-5, shared 1 in 4", "h200"]["indexer_share_flat"]
            < by["GLM-5", "h200"]["indexer_share_flat"])


def test_expert_combine_traffic():
    v32 = get_config("deepseek-v3.2")
    # A ring all-reduce of [tokens, 7168] bf16 over 8 devices per MoE layer (58 of 61).
    assert expert_combine_bytes(v32, 1, 8) == 2 * 7 / 8 * 7168 * 2 * 58
    assert expert_combine_bytes(v32, 1, 1) == 0 and expert_combine_bytes(TINY, 1, 8) == 0
    # On an expert x tensor group each device combines the rows of its sequence shard.
    rows = step_collectives(v32, 4096, 2, 1, expert=4)
    combine = [r for r in rows if r["name"] == "expert-parallel combine"]
    assert combine == [dict(name="expert-parallel combine", kind="all-reduce",
                            axis="expert group", stage="other",
                            bytes=float(2048 * 7168 * 2 * 58))]
    assert not [r for r in step_collectives(v32, 4096, 2, 1) if r["axis"] == "expert group"]


@pytest.mark.slow  # traces the two full-size models' shapes (~30 s)
def test_dsa_capacity():
    v32, glm = (capacity(label, config, 141e9) for label, config in models()[:2])
    assert v32["bytes_per_token_per_layer"] == {"bf16": 1408, "fp8_index_keys": 1284}
    assert v32["parameters"] == 671_877_944_064  # 671B + the indexers' 0.86B
    assert 37e9 < v32["active_parameters_no_embedding"] < 38e9  # published: 37B activated
    assert 743e9 < glm["parameters"] < 745e9  # published: 744B, 40B active
    for c in (v32, glm):
        for m in c["meshes"]:
            assert 0 < m["weights_per_device"] < c["parameters"] * 4


def test_oplist_merges_by_key():
    ops = OpList([Op("indexer", "a", "topk", rows=1, elements=5, k=4),
                  Op("indexer", "a", "topk", rows=2, elements=6, k=4),
                  Op("indexer", "a", "topk", rows=3, elements=7, k=8)])
    merged = sorted((op.k, op.rows, op.elements) for op in ops)
    assert merged == [(4, 3, 11), (8, 3, 7)]


@pytest.mark.parametrize("argv, flag", [
    (["--hardware", "cpu,tpu"], "--hardware"),
    (["--lengths", "4096,abc"], "--lengths"),
    (["--lengths", "0"], "--lengths"),
    (["--preset", "huge"], "--preset"),
    (["--devices", "0"], "--devices"),
    (["--preset", "tiny", "--checkpoint"], "--checkpoint"),
    (["--checkpoint", "/nonexistent/checkpoint"], "--checkpoint"),
])
def test_bad_cli_values_are_usage_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        costmodel.main(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_main_without_calibration_writes_json_and_markdown(tmp_path, capsys):
    result = costmodel.main(["--no-calibrate", "--no-dsa", "--preset", "tiny", "--lengths",
                             "256,512", "--hardware", "a100,h200", "--devices", "2",
                             "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "costmodel.json").read_text())
    assert set(saved) == {"setup", "hardware", "counts", "predictions", "caches", "validation",
                          "dsa_models", "assumptions", "markdown"}
    assert saved["dsa_models"] is None  # --no-dsa
    assert set(saved["hardware"]) == {"a100", "h200"}
    assert saved["setup"]["calibrated"] is False
    assert [(r["hardware"], r["length"], r["devices"]) for r in saved["predictions"]] == [
        ("a100", 256, 2), ("a100", 512, 2), ("h200", 256, 2), ("h200", 512, 2)]
    assert {r["where"] for r in saved["validation"]["rows"]} == {"h200"}
    assert [r["length"] for r in saved["validation"]["ratios"]] == [32768, 65536, 131072]
    assert saved["caches"]["bytes_per_token"]["kv"] == 2 * 256
    assert (tmp_path / "costmodel.md").read_text().startswith("# Cost model: tiny")
    assert result["counts"].keys() == {"256", "512"}
    assert "Validation against measured points" in capsys.readouterr().out


@pytest.mark.slow
def test_main_with_cpu_calibration(tmp_path):
    result = costmodel.main(["--hardware", "cpu", "--lengths", "4096", "--out", str(tmp_path)])
    rates = result["hardware"]["cpu"]
    assert set(rates["flops"]) >= {"matmul", "index_scores", "gathered_scores"}
    assert {r["where"] for r in result["validation"]["rows"]} == {"cpu", "h200"}


def test_reuse_and_streaming_predictions(tmp_path, capsys):
    """--reuse FS: the shared layer runs no selection (a cheaper hierarchical and flat
    indexer, fewer index-key bytes); every row also predicts the streaming selection."""
    argv = ["--no-calibrate", "--no-dsa", "--preset", "tiny", "--lengths", "4096",
            "--hardware", "h200"]
    plain = costmodel.main(argv + ["--out", str(tmp_path / "plain")])
    reuse = costmodel.main(argv + ["--reuse", "FS", "--out", str(tmp_path / "reuse")])
    (p,), (r,) = plain["predictions"], reuse["predictions"]
    for kind in ("flat", "streaming", "hierarchical"):
        assert r[kind]["ttft_s"] < p[kind]["ttft_s"]
    assert p["streaming"]["ttft_s"] > 0 and "streaming TTFT" in plain["markdown"]
    assert (reuse["caches"]["bytes_per_token"]["index_keys"]
            == plain["caches"]["bytes_per_token"]["index_keys"] / 2)
    assert reuse["setup"]["model"] == "tiny, reuse FS"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        costmodel.main(argv + ["--reuse", "SF", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2 and "--reuse SF" in capsys.readouterr().err


def test_the_v4_tables_count_hierarchical_over_entries(tmp_path):
    """`python -m experiments.costmodel v4` at 128K on 8 x H200: V4-Flash and V4-Pro, both
    block sizes, a hierarchical TTFT below flat's and a smaller indexer share, the presets'
    parameters."""
    from experiments.costmodel import v4

    out = v4.main(["--lengths", "131072", "--hardware", "h200", "--out", str(tmp_path)])
    flash, pro = out["models"]
    assert round(flash["parameters"] / 1e9, 1) == 284.3 and pro["preset"] == "deepseek-v4-pro"
    for model in (flash, pro):
        assert [v["fixture_recall"] for v in model["variants"]] == [0.967, 0.891]
        for variant in model["variants"]:
            (row,) = variant["rows"]
            assert row["hardware"] == "h200" and row["devices"] == 8
            assert row["length"] == 131072
            assert row["hierarchical_ttft_s"] < row["flat_ttft_s"]
            assert 0 < row["indexer_share_hierarchical"] < row["indexer_share_flat"] < 1
    text = (tmp_path / "costmodel_v4.md").read_text()
    assert text.startswith("## DeepSeek-V4-Flash") and "## DeepSeek-V4-Pro" in text
