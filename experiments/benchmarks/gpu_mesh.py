"""The whole model on a mesh of GPUs, compiled here: per-device memory of its prefill and
decode steps beside model.memory's prediction.

    python -m experiments.benchmarks.gpu_mesh [--model deepseek-v3.2] [--target h200] \\
        [--mesh tensor=8] [--layers all|2,3,4,5] [--experts fp8|bf16] \\
        [--context 131072] [--chunk 4096] [--indexer flat] [--utilization 0.9] \
        [--check] [--out DIR]

Needs the GPU compiler (`pip install -e '.[cuda12]'`, experiments.gpu_targets). No weights
are made: parameters and cache are shape structs placed by model.sharding's rules on a
mesh (model.sharding.make_mesh) over --target's devices in one host, so XLA partitions the
steps as a GPU host would (SPMD) and `memory_analysis()` gives one device's bytes. Steps:
the last prefill chunk (--chunk queries reading all --context keys, the largest) and one
decode step at position context - 1, both through model.runner's own step. Each row puts
the compiled arguments (weights, cache, tokens), temporaries and peak beside
model.memory.memory_per_device (weights, KV and index cache, working set), with the
peak's ratio to the predicted total and whether it fits the device x --utilization.
--check: exit 1 when a step does not fit or its peak is not within 10% of the prediction
(CI runs a small case). Writes OUT/gpu_mesh.json and OUT/gpu_mesh.md (default runs/gpu_mesh/).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.benchmarks.gpu_compile import FP8_BLOCK  # noqa: E402
from experiments.common import add_out_argument, recorded_command, write_json  # noqa: E402
from experiments.gpu_targets import TARGETS, gpu_target, peak_bytes  # noqa: E402
from model import ModelRunner  # noqa: E402
from model.config import keep_layers  # noqa: E402
from model.memory import memory_per_device  # noqa: E402
from model.parallel_flags import parse_mesh  # noqa: E402
from model.presets import get_config  # noqa: E402
from model.sharding import check_mesh, make_mesh  # noqa: E402

NAME = "gpu_mesh"
GIB = 1 << 30


def mesh_config(args):
    config = get_config(args.model)
    if args.layers != "all":
        config = keep_layers(config, [int(i) for i in args.layers.split(",")])
    config = config.replace(max_seq_len=args.context, prefill_chunk=args.chunk,
                            attention="sparse", indexer=args.indexer)
    if args.experts == "fp8":
        config = config.replace(moe=config.moe.replace(fp8_block=FP8_BLOCK))
    return config


def compile_steps(args):
    """-> one row per step: compiled per-device bytes beside model.memory's."""
    sizes = parse_mesh(args.mesh)
    devices = math.prod(sizes.values())
    target = gpu_target(args.target, devices=devices)
    mesh = make_mesh(sizes, devices=target.devices)
    config = mesh_config(args)
    check_mesh(config, mesh)
    runner = ModelRunner.abstract(config, mesh=mesh)  # shape structs, placed
    cache = runner.abstract_cache(args.context)
    predicted = memory_per_device(config, sizes, args.context)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = []
    for step, T in (("prefill", args.chunk), ("decode", 1)):
        tokens = jax.ShapeDtypeStruct((T,), jnp.int32, sharding=replicated)
        compiled, seconds = target.compile(
            lambda place, tokens=tokens, T=T: runner.lower_step(
                tokens, cache, args.context - T, args.context, T), mesh=mesh)
        m = compiled.memory_analysis()
        peak = peak_bytes(compiled)
        row = {"step": step, "rows": T, "compile_s": round(seconds, 1),
               "argument_bytes": m.argument_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
               "output_bytes": m.output_size_in_bytes, "alias_bytes": m.alias_size_in_bytes,
               "peak_bytes": peak, "predicted": predicted,
               "peak_over_predicted": peak / predicted["total"],
               "device_bytes": target.memory_bytes,
               "fits": peak <= args.utilization * target.memory_bytes}
        rows.append(row)
        print(f"{step:>8}: compile {seconds:.0f} s; per device: arguments "
              f"{row['argument_bytes'] / GIB:.2f} GiB (predicted weights + caches "
              f"{(predicted['total'] - predicted['working_set']) / GIB:.2f}), temporaries "
              f"{row['temp_bytes'] / GIB:.2f} (predicted working set "
              f"{predicted['working_set'] / GIB:.2f}), peak {peak / GIB:.2f} GiB vs predicted "
              f"{predicted['total'] / GIB:.2f} ({row['peak_over_predicted']:.3f}x); fits "
              f"{target.name} x {args.utilization}: {row['fits']}", flush=True)
    return {"model": args.model, "layers": config.n_layers, "target": args.target,
            "mesh": sizes, "devices": devices, "experts": args.experts,
            "context": args.context, "chunk": args.chunk, "indexer": args.indexer,
            "utilization": args.utilization, "rows": rows}


def markdown(payload):
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    lines = [f"`{payload['command']}`", "",
             f"{payload['model']}, {payload['layers']} layers, {payload['experts']} routed "
             f"experts, mesh {payload['mesh']} of {payload['target']} "
             f"({payload['devices']} devices), context {payload['context']}, indexer "
             f"{payload['indexer']}; GiB per device.", "",
             "| step | arguments | predicted weights + caches | temporaries | predicted "
             "working set | peak | predicted total | peak / predicted | fits x "
             f"{payload['utilization']} | compile s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in payload["rows"]:
        p = r["predicted"]
        lines.append(f"| {r['step']} | {gib(r['argument_bytes'])} | "
                     f"{gib(p['total'] - p['working_set'])} | {gib(r['temp_bytes'])} | "
                     f"{gib(p['working_set'])} | {gib(r['peak_bytes'])} | {gib(p['total'])} | "
                     f"{r['peak_over_predicted']:.3f} | {'yes' if r['fits'] else 'NO'} | "
                     f"{r['compile_s']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.benchmarks.gpu_mesh",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("deepseek-v3.2", "glm-5"), default="deepseek-v3.2")
    p.add_argument("--target", choices=sorted(TARGETS), default="h200")
    p.add_argument("--mesh", default="tensor=8", help="mesh axes, e.g. tensor=8")
    p.add_argument("--layers", default="all", help="all, or comma-separated layer indices")
    p.add_argument("--experts", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--indexer", choices=("flat", "hierarchical"), default="flat")
    p.add_argument("--utilization", type=float, default=0.9)
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless every step fits and is within 10%% of model.memory")
    add_out_argument(p, NAME)
    args = p.parse_args(argv)
    try:
        parse_mesh(args.mesh)
    except ValueError as e:
        p.error(f"--mesh: {e}")
    if not 0 < args.chunk <= args.context:
        p.error(f"--chunk must be in [1, --context={args.context}], got {args.chunk}")
    return args


def main(argv=None):
    args = parse_args(argv)
    payload = {"command": recorded_command("experiments.benchmarks.gpu_mesh", argv),
               "jax": jax.__version__, **compile_steps(args)}
    out = pathlib.Path(args.out)
    write_json(out / "gpu_mesh.json", payload)
    (out / "gpu_mesh.md").write_text(markdown(payload))
    failures = [f"{r['step']}: peak / predicted {r['peak_over_predicted']:.3f}, fits "
                f"{r['fits']}" for r in payload["rows"]
                if not (r["fits"] and 0.9 <= r["peak_over_predicted"] <= 1.1)]
    if args.check and failures:
        raise SystemExit("gpu_mesh check failed: " + "; ".join(failures))
    return payload


if __name__ == "__main__":
    main()
