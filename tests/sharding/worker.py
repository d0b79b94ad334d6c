"""Runs in a subprocess with fake CPU devices (XLA_FLAGS set by the caller before JAX
starts); prints one JSON line. Modes:

    python -m tests.sharding.worker equality INDEXER[:TYPES] MESH[;MESH...]
        sharded vs single-device prefill + decode (experiments.benchmarks.sharded.compare);
        TYPES: the tiny model's indexer_types as a pattern (e.g. FS); INDEXER "fixture:F":
        the DSA family fixture F (tests/fixtures/dsa/F) on its own third prompt
    python -m tests.sharding.worker streamed FAMILY[+fp8_experts] MESH
        a DSA fixture loaded straight onto MESH (load_pretrained(mesh=)) vs one device
        (+fp8_experts: the FP8 fixture's experts kept in FP8 on both)
    python -m tests.sharding.worker process ADDRESS NUM_PROCESSES PROCESS_ID MESH
        one process of a jax.distributed job: sharded prefill vs this process's own
        single-device prefill
"""

import json
import pathlib
import sys

import numpy as np

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dsa"
N_TOKENS = 150  # not a multiple of the tiny preset's chunk (64) or block (8)
DECODE_STEPS = 3


def _model(indexer):
    from flax import nnx

    from model import Transformer, get_config

    if indexer.startswith("fixture:"):
        from model.pretrained import load_pretrained

        return load_pretrained(FIXTURES / indexer.split(":", 1)[1]).model
    indexer, _, types = indexer.partition(":")
    return Transformer(get_config("tiny", indexer=indexer, indexer_types=types),
                       rngs=nnx.Rngs(0))


def _tokens(indexer=""):
    if indexer.startswith("fixture:"):
        return np.load(FIXTURES / indexer.split(":", 1)[1] / "reference.npz")["prompt_2"]
    return np.random.default_rng(0).integers(0, 259, N_TOKENS).astype(np.int32)


def batch_decode_diff(model, tokens, mesh_text):
    """Max |logits| difference of one decode_batch step (2 slots, one holding the prefilled
    sequence) on `mesh_text` vs one device (serving's batched decode: a vmap of the step)."""
    import jax

    from model import ModelRunner
    from model.sharding import make_mesh

    out = []
    for runner in (ModelRunner(model), ModelRunner(model, mesh=make_mesh(mesh_text))):
        _, cache = runner.prefill(tokens, capacity=len(tokens) + 1)
        slots = runner.new_batch_cache(2, len(tokens) + 1)
        slots = jax.tree.map(lambda s, c: s.at[0].set(c), slots, cache)
        logits, _ = runner.decode_batch([7, 0], slots, [len(tokens), 0])
        out.append(np.asarray(logits)[0])
    return float(np.max(np.abs(out[0] - out[1])))


def equality(indexer, meshes):
    import jax

    from experiments.benchmarks.sharded import compare

    jax.config.update("jax_disable_most_optimizations", True)  # compile time, as in tests
    model, tokens, reference, out = _model(indexer), _tokens(indexer), None, []
    for i, mesh in enumerate(meshes.split(";")):
        # The first mesh also compiles its first chunk step for its collectives.
        r, reference = compare(model, tokens, mesh, decode_steps=DECODE_STEPS,
                               reference=reference, timed=False, collectives=i == 0)
        out.append(r)
    out[0]["batch_decode_max_abs_diff"] = batch_decode_diff(model, tokens, meshes.split(";")[0])
    return out


def streamed(family, mesh_text):
    import jax
    from flax import nnx

    from experiments.benchmarks.sharded import shardings_follow_rules
    from model import ModelRunner
    from model.pretrained import load_pretrained
    from model.sharding import make_mesh

    # "FOLDER+fp8_experts": an FP8 fixture whose routed experts stay FP8 on the mesh
    family, _, keep = family.partition("+")
    options = {"fp8_experts": True, "dtype": "float32"} if keep == "fp8_experts" else {}
    mesh = make_mesh(mesh_text)
    on_mesh = load_pretrained(FIXTURES / family, mesh=mesh, **options).model
    state = nnx.state(on_mesh)
    placed = shardings_follow_rules(state, [])  # the loader placed them, not the runner
    on_mesh_devices = {d.id for x in jax.tree.leaves(state) for d in x.sharding.device_set}
    tokens = _tokens(f"fixture:{family.removesuffix('_fp8')}")
    got, _ = ModelRunner(on_mesh, mesh=mesh).prefill(tokens)
    want, _ = ModelRunner(load_pretrained(FIXTURES / family, **options).model).prefill(tokens)
    return {"placed_by_rules": bool(placed), "devices": len(on_mesh_devices),
            "max_abs_diff": float(np.max(np.abs(np.asarray(got) - np.asarray(want)))),
            "scale": float(np.max(np.abs(np.asarray(want))))}


def process(address, num_processes, process_id, mesh_text):
    from model.sharding import initialize_distributed, make_mesh

    initialize_distributed(address, int(num_processes), int(process_id))
    import jax

    from model import ModelRunner

    model, tokens = _model("flat"), _tokens()
    mesh = make_mesh(mesh_text)
    sharded = ModelRunner(model, mesh=mesh)
    logits, cache, got = sharded.prefill(tokens, capture=("indices",))
    single = ModelRunner(model)  # this process's first local device only
    ref_logits, _, ref = single.prefill(tokens, capture=("indices",))
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "global_devices": len(jax.devices()), "local_devices": jax.local_device_count(),
            "logits": np.asarray(logits).tolist(),
            "max_abs_diff": float(np.max(np.abs(np.asarray(logits) - np.asarray(ref_logits)))),
            "indices_equal": bool(np.array_equal(got["indices"], ref["indices"])),
            # cache[0].k: [layers, rows, kv heads, head_dim], rows split over "sequence"
            "kv_shard_rows": cache[0].k.addressable_shards[0].data.shape[1],
            "kv_rows": cache[0].k.shape[1]}


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    result = {"equality": equality, "process": process, "streamed": streamed}[mode](*args)
    print("RESULT " + json.dumps(result), flush=True)
