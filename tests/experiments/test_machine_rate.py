"""experiments.ttft.machine_rate: the model FLOPs a prefill must do and the matmul rate
the study measures beside it."""

import pytest

from experiments.ttft.machine_rate import add_rates, matmul_rate, model_flops
from model import get_config


def test_model_flops_follow_the_mode():
    config = get_config("tiny").replace(max_seq_len=4096, top_k=64)
    L = 2048
    flat = model_flops(config, L)
    dense = model_flops(config.replace(attention="dense"), L)
    # Dense attends every causal key, sparse at most top_k: with L >> top_k, dense does more
    # attention but no selection; and every sparse query below top_k keys reads them all.
    assert dense > 0 and flat > 0 and dense != flat
    assert model_flops(config, 2 * L) > 2 * flat  # the indexer grows with L^2
    # Below top_k keys a sparse query reads every key, as dense does: sparse then costs
    # dense plus its selection.
    short, short_dense = model_flops(config, 32), model_flops(config.replace(
        attention="dense"), 32)
    assert short > short_dense

def test_add_rates_divides_the_flops_by_the_fastest_ttft():
    rows = [{"model_tflop": 2.0, "ttft_ms": {"min": 4000.0}},
            {"model_tflop": 2.0, "ttft_ms": None},  # untimed
            {"skipped": "x"}]
    add_rates(rows, rate=100.0)
    assert rows[0]["achieved_gflops"] == pytest.approx(500.0)
    assert rows[0]["matmul_share"] == pytest.approx(5.0)
    assert "achieved_gflops" not in rows[1] and "achieved_gflops" not in rows[2]


def test_matmul_rate_is_measured_on_the_models_mlp_shape():
    config = get_config("tiny")
    rate = matmul_rate(config, repeats=2)
    assert rate["gflops"] > 0
    assert rate["shape"] == (f"f32 [{config.prefill_chunk}, {config.d_model}] x "
                             f"[{config.d_model}, {config.d_ff}]")
