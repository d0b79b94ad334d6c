"""Sharded prefill and decode (model.sharding, model.sequence_parallel).

The equality tests run in subprocesses with 8 fake CPU devices (XLA_FLAGS must be set
before JAX starts); they are slow-tier. The default tier checks the mesh, rules and flag
validation only (one device, no compile).
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from experiments.costmodel.sharding import by_kind, step_collectives
from model import Transformer, get_config, init_cache
from model.architecture import MoEConfig
from model.cache import cache_specs
from model.sharding import (
    check_capacity,
    check_mesh,
    distributed_settings,
    make_mesh,
    param_specs,
    parse_mesh,
)
from tests.helpers import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(args, devices, timeout=240):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.worker", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_mesh_rules_and_flags_validation():
    assert parse_mesh("sequence=4,tensor=2") == {"data": 1, "sequence": 4, "expert": 1,
                                                 "tensor": 2}
    assert parse_mesh("expert=4,tensor=2")["expert"] == 4
    for bad in ("", "sequence", "sequence=0", "pipeline=2", "sequence=2,sequence=2",
                "sequence=-1"):
        with pytest.raises(ValueError, match="--mesh"):
            parse_mesh(bad)
    n = len(jax.devices())  # 1 here, 8 on an 8-GPU host: ask for one more than there are
    with pytest.raises(ValueError, match=f"needs {n + 1} devices, there are {n}"):
        make_mesh(f"sequence={n + 1}")
    config = get_config("tiny")  # 4 heads, 2 kv heads, d_ff 128
    for tensor, name in ((3, "n_heads"), (4, "n_kv_heads")):
        with pytest.raises(ValueError, match=f"tensor={tensor} must divide ModelConfig.{name}"):
            check_mesh(config, {"data": 1, "sequence": 1, "tensor": tensor})
    check_mesh(config, {"tensor": 2})
    with pytest.raises(ValueError, match="expert=2 splits routed experts, and this model has "
                                         "none"):
        check_mesh(config, {"expert": 2})
    moe = get_config("tiny", moe=MoEConfig(n_routed_experts=6, num_experts_per_tok=2,
                                           moe_intermediate_size=32))
    check_mesh(moe, {"expert": 3, "tensor": 2})
    with pytest.raises(ValueError, match=r"expert x tensor = 2 x 2 must divide "
                                         r"ModelConfig.moe.n_routed_experts=6.*\[1, 2, 3, 6\]"):
        check_mesh(moe, {"expert": 2, "tensor": 2})
    # Routed experts split whole over expert x tensor; their hidden dimension stays whole.
    # Stacked layers (model.layer_stack) lead with their "layers" axis, whole everywhere.
    stacks = param_specs(nnx.state(nnx.eval_shape(lambda: Transformer(moe, rngs=nnx.Rngs(0)))))[
        "stacks"]
    mlp = next(stacks[s]["mlp"] for s in stacks if "gate" in stacks[s]["mlp"])
    assert mlp["gate"].get_value() == P(None, ("expert", "tensor"), None, None)
    assert mlp["down"].get_value() == P(None, ("expert", "tensor"), None, None)
    assert mlp["shared"]["down"]["kernel"].get_value() == P(None, "tensor", None)
    with pytest.raises(ValueError, match="multiple of the mesh's sequence=3"):
        check_capacity({"sequence": 3}, 256)
    # Every parameter has a rule; heads and the MLP split over "tensor", the rest whole.
    state = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    specs = param_specs(state)
    layer = specs["stacks"][0]
    assert layer["attn"]["wq"]["kernel"].get_value() == P(None, None, "tensor")
    assert layer["attn"]["wo"]["kernel"].get_value() == P(None, "tensor", None)
    assert layer["mlp"]["down"]["kernel"].get_value() == P(None, "tensor", None)
    assert layer["indexer"]["wq"]["kernel"].get_value() == P(None, None, None)
    cache = cache_specs(jax.eval_shape(lambda: init_cache(config, 256)))
    assert cache[0].k == P(None, "sequence", "tensor", None)
    assert cache[0].k_index == P(None, None, None)
    assert all(s == P(None, None) or s == P(None, None, None) for s in cache[0].summaries)
    assert distributed_settings(environ={}) == (None, 1, None)
    assert distributed_settings(environ={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES":
                                         "2", "JAX_PROCESS_ID": "1"}) == ("h:1", 2, 1)
    with pytest.raises(ValueError, match="--coordinator-address"):
        distributed_settings(num_processes=2, process_id=0, environ={})
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, 1\]"):
        distributed_settings("h:1", 2, 5, environ={})
    # Serving takes the flags (tests/sharding/test_sharded_serving.py serves on meshes):
    # malformed ones and several processes without a mesh are refused before JAX starts,
    # a mesh that does not fit the devices when it is made, each naming the flag.
    from serving.__main__ import check_parallel_flags, parse_args, serving_mesh

    assert check_parallel_flags(parse_args(["--mesh", "sequence=2,tensor=2"])) == 1
    with pytest.raises(ValueError, match="--num-processes=2 needs --mesh"):
        check_parallel_flags(parse_args(["--num-processes", "2", "--process-id", "0",
                                         "--coordinator-address", "h:1"]))
    with pytest.raises(ValueError, match="--mesh: unknown axis 'pipeline'"):
        check_parallel_flags(parse_args(["--mesh", "pipeline=2"]))
    with pytest.raises(ValueError, match=f"--mesh: .* needs {n + 1} devices, there are {n}"):
        serving_mesh(parse_args(["--mesh", f"sequence={n + 1}"]))
    assert serving_mesh(parse_args([])) is None


def _check_equal(r, *, exact_indices):
    ix = r["indices"]
    assert r["last_logits_max_abs_diff"] < 1e-4 * max(1.0, r["last_logits_scale"]), r
    assert r["same_next_token"] and r["decode_tokens_equal"], r
    assert r["decode_logits_max_abs_diff"] < 1e-4 * max(1.0, r["last_logits_scale"]), r
    assert ix["other"] == 0, ix  # every differing row is a near-tie of the exact scores
    if exact_indices:
        assert ix["identical"] == ix["rows"], ix
    assert ix["near_tie_share"] < 1e-3, ix
    assert r["shardings_follow_rules"], r
    m = r["memory"]
    # The KV cache splits over sequence x tensor; indexer keys + summaries stay whole.
    assert m["kv_per_device"] * r["sequence"] * r["tensor"] == m["kv_total"], m
    assert m["replicated_per_device"] == m["replicated_total"], m


@pytest.mark.slow
@pytest.mark.parametrize("indexer,meshes", [
    ("flat", "sequence=8;tensor=2,data=4;sequence=2,tensor=2,data=2"),
    ("hierarchical", "sequence=8;sequence=4,tensor=2"),
    ("hierarchical:FS", "sequence=4,tensor=2"),  # layer 1 reuses layer 0's selection
])
def test_sharded_prefill_and_decode_equal_one_device(indexer, meshes):
    results = _run(["equality", indexer, meshes], devices=8)
    assert results[0]["batch_decode_max_abs_diff"] < 1e-4  # serving's vmapped decode step
    # The compiled collectives are the cost model's, byte for byte (so no whole-cache
    # gather crept in).
    first = results[0]
    kind, _, types = indexer.partition(":")
    predicted = by_kind(step_collectives(get_config("tiny", indexer=kind, indexer_types=types),
                                         first["collectives"]["rows"], first["sequence"],
                                         first["tensor"]))
    assert first["collectives"]["bytes"] == predicted
    for r in results:
        print(r["mesh"], r["indices"], r["memory"])  # near-tie share and bytes, with -s
        _check_equal(r, exact_indices=r["sequence"] > 1 and r["tensor"] == 1)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_families_shard_like_one_device(family):
    """MLA + MoE (+ GLM-5's shared layers) on meshes: the latent cache splits over the
    sequence axis and stays whole on each tensor shard (one head serves all heads)."""
    results = _run(["equality", f"fixture:{family}", "expert=2,tensor=2,sequence=2;"
                    "sequence=4,tensor=2;sequence=8;expert=4,tensor=2;expert=8"], devices=8)
    # serving's vmapped decode step on the first mesh (experts split over expert x tensor)
    assert results[0]["batch_decode_max_abs_diff"] < 1e-5 * max(
        1.0, results[0]["last_logits_scale"]), results[0]
    for r in results:
        print(r["mesh"], r["last_logits_max_abs_diff"], r["decode_logits_max_abs_diff"],
              r["indices"]["identical"], r["indices"]["rows"])  # the table, with -s
        # float32 throughout: the expert group's psum adds the experts' shares in another
        # order than one device does, nothing else differs.
        assert r["last_logits_max_abs_diff"] < 1e-5 * max(1.0, r["last_logits_scale"]), r
        assert r["decode_logits_max_abs_diff"] < 1e-5 * max(1.0, r["last_logits_scale"]), r
        assert r["same_next_token"] and r["decode_tokens_equal"], r
        assert r["indices"]["identical"] == r["indices"]["rows"], r["indices"]
        assert r["shardings_follow_rules"], r
        m = r["memory"]
        assert m["kv_per_device"] * r["sequence"] == m["kv_total"], m
        assert m["replicated_per_device"] == m["replicated_total"], m
    # Loaded straight onto a mesh: every parameter already where the rules put it.
    r = _run(["streamed", family, "expert=2,tensor=2,data=2"], devices=8)
    assert r["placed_by_rules"] and r["devices"] == 8, r
    assert r["max_abs_diff"] < 1e-4 * max(1.0, r["scale"]), r
    if family == "deepseek_v32":  # FP8 experts stay FP8, split over the expert group
        r = _run(["streamed", "deepseek_v32_fp8+fp8_experts", "expert=2,tensor=2,sequence=2"],
                 devices=8)
        assert r["placed_by_rules"] and r["devices"] == 8, r
        assert r["max_abs_diff"] < 1e-5 * max(1.0, r["scale"]), r


@pytest.mark.slow
def test_two_processes_agree_with_one():
    address = f"localhost:{free_port()}"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # two writers of one cache entry
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sharding.worker", "process",
                               address, "2", str(i), "sequence=2,tensor=2"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-4000:]
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")][-1]
        outs.append(json.loads(line[len("RESULT "):]))
    for i, r in enumerate(outs):
        assert (r["process_index"], r["process_count"]) == (i, 2)
        assert (r["global_devices"], r["local_devices"]) == (4, 2)
        assert r["max_abs_diff"] < 1e-4 and r["indices_equal"], r
        assert r["kv_shard_rows"] * 2 == r["kv_rows"]
    assert outs[0]["logits"] == outs[1]["logits"]
