"""The kernel microbenchmark (python -m pallas_kernels.bench): its correctness section really
compares each kernel with its reference on fresh inputs, its report, and the CPU smoke run."""

import json

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels.api
from pallas_kernels import bench, bench_common
from pallas_kernels.gathered_index_scores import gathered_index_scores_reference
from pallas_kernels.index_scores import index_scores_reference
from pallas_kernels.sparse_attention import sparse_attention_reference

# The kernels the correctness section checks; the first three also have timed sections.
KERNELS = ("index_scores", "gathered_index_scores", "sparse_attention", "grouped_matmul")


def _break(out, how, poison):
    if how == "shifted":  # every finite entry 0.1 off: beyond any tolerance here
        return out + jnp.asarray(0.1, out.dtype)
    if how == "unwritten":  # one row never written: it keeps the poison (else stale zeros)
        return out.at[0].set(0.0 if poison is None else poison)
    return out


def _stand_ins(monkeypatch, broken=None, how=None):
    """Replaces the Pallas kernels (also behind the public dispatch) by their references,
    which are fast on CPU; the `broken` one is made wrong `how`."""

    def scores(q, w, k, q_offset=0, *, key_block_size=1, causal=True, config=None,
               interpret=False, poison=None):
        out = index_scores_reference(q, w, k, q_offset=q_offset, key_block_size=key_block_size,
                                     causal=causal)
        return _break(out, how if broken == "index_scores" else None, poison)

    def gathered(q, w, k, bt, q_offset=0, *, block_size, config=None, interpret=False,
                 poison=None):
        out = gathered_index_scores_reference(q, w, k, bt, block_size=block_size,
                                              q_offset=q_offset)
        return _break(out, how if broken == "gathered_index_scores" else None, poison)

    def sparse(q, k, v, idx, *, scale=None, config=None, interpret=False, poison=None):
        out = sparse_attention_reference(q, k, v, idx, scale=scale)
        return _break(out, how if broken == "sparse_attention" else None, poison)

    # Jitted like the kernels (q_offset traced), so the test does not compile op by op.
    static = ("config", "interpret", "poison")
    scores = jax.jit(scores, static_argnames=(*static, "key_block_size", "causal"))
    gathered = jax.jit(gathered, static_argnames=(*static, "block_size"))
    sparse = jax.jit(sparse, static_argnames=(*static, "scale"))
    monkeypatch.setattr(bench_common, "index_scores_pallas", scores)
    monkeypatch.setattr(bench_common, "gathered_index_scores_pallas", gathered)
    monkeypatch.setattr(bench_common, "sparse_attention_pallas", sparse)
    monkeypatch.setattr(pallas_kernels.api, "index_scores_pallas", scores)

    def grouped(lhs, rhs, sizes, **kwargs):  # the bench calls the public op, interpreted
        out = pallas_kernels.api.grouped_matmul_reference(lhs, rhs, sizes, **kwargs)
        if broken == "grouped_matmul":  # 10% of its largest entry off: beyond the tolerance
            return out + 0.1 * jnp.abs(out).max()
        return out

    monkeypatch.setitem(pallas_kernels.api.OPS["grouped_matmul"].implementations, "interpret",
                        pallas_kernels.api.Implementation(grouped))


def _correctness(tmp_path, *extra):
    data = bench.main(["--smoke", "--sections", "correctness", "--out", str(tmp_path), *extra])
    assert data["errors"] == []
    return {c["name"]: c for c in data["correctness"]}


@pytest.mark.parametrize("broken,how", [
    pytest.param("index_scores", "unwritten", marks=pytest.mark.slow),
    pytest.param("gathered_index_scores", "shifted", marks=pytest.mark.slow),
    ("sparse_attention", "shifted"),
    pytest.param("grouped_matmul", "shifted", marks=pytest.mark.slow),
    pytest.param("sparse_attention", "unwritten", marks=pytest.mark.slow)])
@pytest.mark.slow  # a heavy equivalence: default-tier headroom
def test_correctness_fails_exactly_the_wrong_kernel(tmp_path, monkeypatch, broken, how):
    _stand_ins(monkeypatch, broken, how)
    checks = _correctness(tmp_path)
    assert {name.split()[0] for name in checks} == {*KERNELS, "api"}
    failed = {name for name, c in checks.items() if not c["ok"]}
    users = {broken, "api"} if broken == "index_scores" else {broken}  # api: the same kernel
    assert failed == {name for name in checks if name.split()[0] in users}
    # The section poisons kernel outputs (not the dispatch's): an unwritten row shows as NaN.
    assert all(checks[name]["nan"] == (how == "unwritten") for name in failed
               if not name.startswith("api"))


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_correctness_inputs_are_fresh_unless_seeded(tmp_path, monkeypatch):
    _stand_ins(monkeypatch)
    first, second = _correctness(tmp_path), _correctness(tmp_path)
    assert all(c["ok"] for c in first.values())
    # Fresh inputs: the runs differ (a single case may coincide by chance in its maximum).
    assert sum(first[n]["max_abs_ref"] != second[n]["max_abs_ref"] for n in first) >= 2
    seeded = [_correctness(tmp_path, "--seed", "5") for _ in range(2)]
    assert all(seeded[0][n]["max_abs_ref"] == seeded[1][n]["max_abs_ref"] for n in first)
    saved = json.loads((tmp_path / "pallas_bench.json").read_text())
    assert saved["args"]["seed"] == 5


def test_report_keys_and_no_paths(tmp_path, capsys):
    out = tmp_path / "some" / "dir"
    bench.main(["--smoke", "--sections", "matmul", "--out", str(out)])
    text = (out / "pallas_bench.json").read_text()
    saved = json.loads(text)
    assert {"args", "smoke", "env", "correctness", "tuning", "results", "errors", "notes",
            "elapsed_s", "chosen_configs"} <= set(saved)
    assert saved["smoke"] is True and "out" not in saved["args"]
    assert str(tmp_path) not in text
    assert set(saved["chosen_configs"]) == set(KERNELS[:3])  # the tuned (timed) kernels
    assert [r["section"] for r in saved["results"]] == ["matmul"]
    assert saved["env"]["matmul_tflops"] == pytest.approx(
        2 * 8 * 256**3 / (saved["results"][0]["time_s"] * 8) / 1e12)
    assert "NOT performance figures" in capsys.readouterr().out


@pytest.mark.slow
def test_smoke_run_every_section(tmp_path):
    data = bench.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "pallas_bench.json").read_text())
    assert saved["errors"] == [] and data["errors"] == []
    assert {c["name"].split()[0] for c in saved["correctness"]} == {*KERNELS, "api"}
    assert all(c["ok"] for c in saved["correctness"]), saved["correctness"]
    rows = saved["results"]
    assert {r["section"] for r in rows} == {"matmul", "scores", "gathered", "attention"}
    timed = {r["name"]: r for r in rows}
    for kernel in KERNELS[:3]:  # each timed kernel's row has a reference row, compared in speed
        refs = [r for r in rows if r["name"].startswith(f"{kernel} reference (xla)")]
        assert len(refs) == 1, (kernel, rows)
        mine = timed[refs[0]["name"].replace("reference (xla)", "(interpret)")]
        assert refs[0]["speedup"] == pytest.approx(refs[0]["time_s"] / mine["time_s"],
                                                   abs=0.006)
