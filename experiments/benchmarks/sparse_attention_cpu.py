"""Sparse attention on a CPU against the machine's own matmul rate, on SmolLM2's real
selections.

    python -m experiments.benchmarks.sparse_attention_cpu [--lengths 8192] [--queries 1024]
        [--layers 0,10,20,29] [--tiles 64x32x8,32x32x8] [--repeats 3] [--out DIR]

For each length L: SmolLM2-135M with its shipped indexer prefills L held-out tokens once,
capturing every layer's selection (flat and hierarchical, in turn) of the last --queries
positions. Then, per chosen layer, side by side and interleaved (best of --repeats after a
warm-up): pallas_kernels.sparse_attention's "xla" implementation (per-query gathers) and
"xla_blocks" at each tile shape (rows x block x steps: a tile's union of selected key
blocks, pallas_kernels.sparse_attention_blocks), on random q / k / v of the model's
shapes (the cost depends on the selection, not on the values; the outputs are checked
equal). Beside them, in the same process, the f32 matmul rate of the model's own MLP
shape ([prefill_chunk, d_model] x [d_model, d_ff], experiments.ttft.machine_rate). Printed:
seconds, the selected work's rate
(4 x heads x head_dim FLOP per selected (query, key) pair) and its share of the matmul
rate, and the union's keys per query over top_k (the extra work blocks pay).

Writes OUT/sparse_attention_cpu.json (default runs/sparse_attention_cpu/); the captured
selections stay in runs/sparse_attention_cpu_selections/ (--reuse reads them again).
"""

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import default_out_dir
from experiments.costmodel.cpu_rates import _best_seconds_interleaved
from experiments.ttft.machine_rate import matmul_rate
from pallas_kernels import sparse_attention
from pallas_kernels.sparse_attention_blocks import BlockTiles, union_keys

# Captured selections (30 layers x queries x top_k int32: 126 MB at 1024 queries), kept
# apart from --out so that a results folder holds results only.
SELECTIONS = default_out_dir("sparse_attention_cpu_selections")


def parse_tiles(text):
    return [BlockTiles(*map(int, t.split("x"))) for t in text.split(",") if t]


def captured_selections(length, queries, indexer_name):
    """i32[n_layers, queries, top_k]: SmolLM2's selections of the last `queries` positions
    of a prefill of `length` held-out tokens, and the model's config."""
    from experiments.model_source import load_source
    from model.runner import ModelRunner

    source = load_source(model_name="smollm2-135m", max_length=length, indexer=indexer_name)
    tokens = np.asarray(source.heldout_tokens[:length], np.int32)
    runner = ModelRunner(source.model)
    _, _, captured = runner.prefill(tokens, capture=("indices",),
                                    capture_from=length - queries)
    return np.asarray(captured["indices"]), source.model.config


def bench(indices, config, length, tiles_list, repeats, rate):
    T, K = indices.shape
    H, H_kv = config.n_heads, config.n_kv_heads
    D = config.head_dim
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((length, H_kv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((length, H_kv, D)), jnp.float32)
    idx = jnp.asarray(indices)
    calls = {"xla": jax.jit(lambda q, k, v, i: sparse_attention(q, k, v, i, backend="xla"))}
    from pallas_kernels.api import _sparse_attention_blocks

    for t in tiles_list:
        calls[f"blocks {t.rows}x{t.block}x{t.steps}"] = jax.jit(
            lambda q, k, v, i, t=t: _sparse_attention_blocks(q, k, v, i, tiles=t))
    outs = {n: np.asarray(f(q, k, v, idx)) for n, f in calls.items()}
    for n, o in outs.items():
        err = float(np.max(np.abs(o - outs["xla"])))
        if err > 1e-4:
            raise AssertionError(f"{n} differs from xla by {err}")
    seconds = _best_seconds_interleaved([(f, (q, k, v, idx)) for f in calls.values()],
                                        repeats)
    selected = int((indices >= 0).sum())
    flops = 4 * H * D * selected
    row = {"queries": T, "top_k": K, "selected_pairs": selected, "modes": {}}
    for (name, _), s in zip(calls.items(), seconds):
        entry = {"seconds": s, "selected_gflops": flops / s / 1e9,
                 "share_of_matmul_rate": flops / s / rate}
        for t in tiles_list:
            if name == f"blocks {t.rows}x{t.block}x{t.steps}":
                entry["union_keys_per_query_over_top_k"] = float(
                    union_keys(indices, length, t).mean() / K)
        row["modes"][name] = entry
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192")
    parser.add_argument("--queries", type=int, default=1024)
    parser.add_argument("--layers", default="0,10,20,29")
    parser.add_argument("--indexers", default="flat,hierarchical")
    parser.add_argument("--tiles", default="64x32x8,32x32x8,128x32x8,64x64x4,64x16x16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/sparse_attention_cpu")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse the selections an earlier run captured (runs/"
                             "sparse_attention_cpu_selections/)")
    args = parser.parse_args(argv)
    tiles_list = parse_tiles(args.tiles)
    layers = [int(x) for x in args.layers.split(",")]
    argv = sys.argv[1:] if argv is None else argv
    results = {"command": "python -m experiments.benchmarks.sparse_attention_cpu "
                          + " ".join(argv), "rows": []}
    for length in map(int, args.lengths.split(",")):
        for indexer_name in args.indexers.split(","):
            t0 = time.perf_counter()
            saved = SELECTIONS / f"{length}_{indexer_name}.npy"
            if args.reuse and saved.exists():
                from model.pretrained import load_pretrained

                sel = np.load(saved)
                config = load_pretrained("smollm2-135m", max_seq_len=length).model.config
            else:
                sel, config = captured_selections(length, args.queries, indexer_name)
                saved.parent.mkdir(parents=True, exist_ok=True)
                np.save(saved, sel)
            print(f"{length} {indexer_name}: selections captured in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            measured = matmul_rate(config)
            rate = measured["gflops"] * 1e9
            print(f"  f32 matmul rate {measured['shape']}: {measured['gflops']:.1f} GFLOP/s",
                  flush=True)
            for layer in layers:
                row = bench(sel[layer], config, length, tiles_list, args.repeats, rate)
                row.update(length=length, indexer=indexer_name, layer=layer,
                           matmul_gflops=rate / 1e9)
                results["rows"].append(row)
                for name, e in row["modes"].items():
                    extra = e.get("union_keys_per_query_over_top_k")
                    print(f"  layer {layer:2d} {name:18s} {e['seconds'] * 1e3:8.1f} ms "
                          f"{e['selected_gflops']:6.1f} GFLOP/s "
                          f"({e['share_of_matmul_rate']:.2f} of matmul)"
                          + (f" union/top_k {extra:.2f}" if extra else ""), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse_attention_cpu.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'sparse_attention_cpu.json'}")


if __name__ == "__main__":
    main()
