"""A DSA checkpoint streams onto its devices as it loads: host memory grows by about the
model, not twice the model. A generated folder (20+ shards, ~300 MB in float32, V3.2's
layout at a small width; written here with numpy, never committed) is loaded in a fresh
process that reports its peak resident memory."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "dsa" / "deepseek_v32"

PROBE = """
import json, resource, sys
import numpy as np
# Everything but the weights first: JAX, dosa, the readers, a tokenizer, a traced model.
import jax, safetensors.numpy, tokenizers
from model.pretrained import load_pretrained
from model.pretrained.safetensors_dir import SafetensorsCheckpoint
load_pretrained(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
pre = load_pretrained(sys.argv[1], dtype="float32")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
c = SafetensorsCheckpoint(sys.argv[1])
sizes = [int(np.prod(c._header(c.index[n])[0][n][1])) * 4 for n in c.names]
model = sum(x.nbytes for x in jax.tree.leaves(__import__("flax").nnx.state(pre.model)))
print("RESULT " + json.dumps({"growth": after - before, "model": model,
                              "largest": max(sizes), "shards": len(c.files)}))
"""


def _write_folder(path, *, hidden=512, layers=6, experts=16, shards=24):
    """A V3.2-layout checkpoint of ~320 MB float32 in `shards` files (random weights)."""
    from safetensors.numpy import save_file

    from model.pretrained.mla_moe import dsa_config, tensor_map
    from model.pretrained.safetensors_dir import DSA_FAMILIES

    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(hidden_size=hidden, num_hidden_layers=layers, n_routed_experts=experts,
                  intermediate_size=4 * hidden, moe_intermediate_size=hidden,
                  q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, num_attention_heads=8,
                  num_key_value_heads=8, qk_nope_head_dim=64, qk_rope_head_dim=32,
                  v_head_dim=64, index_head_dim=64, vocab_size=4096,
                  mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((FIXTURE / f).read_bytes())
    shapes = {name: entry[3] for name, entry in tensor_map(dsa_config(
        config, DSA_FAMILIES["deepseek_v32"], source=path)).items()}
    names = list(shapes)
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.asarray(names, object), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for name in chunk:
            tensors[name] = rng.standard_normal(shapes[name], np.float32) * 0.02
        save_file(tensors, str(path / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.slow  # writes and loads ~300 MB
def test_a_sharded_checkpoint_loads_within_the_model_plus_two_tensors(tmp_path):
    folder = tmp_path / "v32-small"
    _write_folder(folder)
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(FIXTURE)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads([x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    print(r)  # the figure of record, with -s
    assert r["shards"] >= 20 and r["model"] >= 250e6
    assert r["growth"] <= r["model"] + 2 * r["largest"] + 64 * 2**20, r
