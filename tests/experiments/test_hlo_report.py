"""experiments.benchmarks.hlo_report: FLOPs of an optimized module's matrix products with
while loops counted by their trip counts, and the buffer-assignment reader the GPU compile
check lists its largest temporaries with (CPU compiles here; the same text on GPU)."""

import jax
import jax.numpy as jnp
import pytest

from experiments.benchmarks.gpu_compile import check, parse_args
from experiments.benchmarks.hlo_report import DotFlops, temp_buffers


def test_dot_flops_count_loops_by_trip_count_and_the_larger_branch():
    def f(a, b):
        def body(i, acc):  # depends on i: XLA cannot hoist the product out of the loop
            return acc + jnp.tanh((a * i) @ b)[:, :8].sum()
        y = jax.lax.fori_loop(0, 7, body, 0.0)
        z = jax.lax.cond(y > 0, lambda: (a @ b).sum(), lambda: (a[:, :16] @ b[:16]).sum())
        return y + z + (a.T @ a).sum()

    a, b = jnp.ones((32, 48)), jnp.ones((48, 64))
    counted = DotFlops(jax.jit(f).lower(a, b).compile().as_text())
    mm = 2 * 32 * 48 * 64
    assert counted.total == 7 * mm + mm + 2 * 48 * 32 * 48
    assert counted.unknown_trip_counts == 0


def test_temp_buffers_read_the_temporary_allocations_only():
    text = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <1 p @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 4096, preallocated-temp:
 value: <2 fusion.1 @0> (size=1024,offset=0): bf16[512]{0}
 value: <3 dot.2 @0> (size=4096,offset=0): f32[32,32]{1,0}
"""
    assert temp_buffers(text) == [(4096, "dot.2", "f32[32,32]"), (1024, "fusion.1", "bf16[512]")]


def test_check_refuses_what_does_not_fit_or_densifies():
    row = dict(model="m", target="h100", part="moe", step="prefill", indexer="-",
               experts="bf16", fits=True, peak_bytes=1 << 30, dense_buffers=[],
               largest=[{"bytes": 1 << 29, "op": "x", "instruction": "i"}])
    assert check([row], 1.0) == []
    assert len(check([row | {"fits": False}], 1.0)) == 1
    assert len(check([row | {"dense_buffers": [{"bytes": 1}]}], 1.0)) == 1
    assert len(check([row], 0.25)) == 1


def test_cli_names_bad_values():
    with pytest.raises(SystemExit):
        parse_args(["--use", "grouped_matmul=cublas"])
    with pytest.raises(SystemExit):
        parse_args(["--target", "b200"])
    assert parse_args(["--use", "grouped_matmul=xla"]).use == {"grouped_matmul": "xla"}
