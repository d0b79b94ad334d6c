"""The GPU compile check: compiles, on this CPU machine, what a GPU would run for a
real-size DSA model, and reports whether it fits the device.

    python -m experiments.benchmarks.gpu_compile [--target h100,h200] \\
        [--model deepseek-v3.2,glm-5] [--parts moe,slice] [--layers 2,3,4,5] \\
        [--context 131072] [--chunk 4096] [--indexers flat,hierarchical] \\
        [--steps prefill,decode] [--experts bf16,fp8] [--use grouped_matmul=xla] \\
        [--xla-flops] [--utilization 0.9] [--out DIR]

Needs the GPU compiler: `pip install -e '.[cuda12]'` (experiments.gpu_targets). Random
weights are never made: parameters, cache and tokens are shape structs, so a 37B-parameter
slice compiles in seconds on 2 cores.

Parts, one row per (model, target, part, step, indexer, experts):
- moe: the model's MoE block alone on one prefill chunk (`--chunk` tokens);
- slice: layers `--layers` of the model at full width (each keeps its dense / MoE kind),
  one prefill chunk ending at `--context` (`--steps prefill`) and one decode step at
  position context - 1 (`decode`), through model.runner's own step.
Each row: temporary / argument / output bytes from `memory_analysis()`; the peak
(arguments + temporaries + outputs not aliased to an argument) against the device's memory
x `--utilization` (serving's GPU_UTILIZATION default); the largest temporary buffers and
the JAX operations that make them (XLA's buffer assignment); the kernels (custom calls);
what each kernel op resolved to (pallas_kernels' table); compile seconds. moe rows add
whether a buffer carries both the assignment rows and the expert axis (XLA's dense
ragged_dot does) and the grouped matmul's work over the chosen experts' (tile rows /
routed rows, the router run on random tokens here).
--use OP=IMPL,...: run those kernel ops with that implementation (the "before" rows:
grouped_matmul=xla is jax.lax.ragged_dot). --xla-flops: compile each step once more with
every op's plain-XLA implementation (the grouped matmul's row-tile loop: ragged_dot's
dense product would count every expert) and put the FLOPs of its matrix products
(experiments.benchmarks.hlo_report) beside model.costs' count of the same step.
Writes OUT/gpu_compile.json and OUT/gpu_compile.md (default runs/gpu_compile/).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import pallas_kernels  # noqa: E402
from experiments.benchmarks.hlo_report import DotFlops, largest_temporaries, temp_buffers  # noqa: E402
from experiments.common import add_out_argument, recorded_command, write_json  # noqa: E402
from experiments.gpu_targets import TARGETS, gpu_target, peak_bytes  # noqa: E402
from model import ModelRunner  # noqa: E402
from model.buckets import Chunk  # noqa: E402
from model.cache import init_cache  # noqa: E402
from model.config import keep_layers  # noqa: E402
from model.costs import prefill_counts  # noqa: E402
from model.moe import MoE, route  # noqa: E402
from model.presets import get_config  # noqa: E402
from pallas_kernels.grouped_matmul import rows_per_tile, tile_work  # noqa: E402

NAME = "gpu_compile"
MODELS = ("deepseek-v3.2", "glm-5", "deepseek-v4-flash")
FP8_BLOCK = (128, 128)  # the released checkpoints' block scales
# The plain-XLA implementation of every kernel op, for the FLOPs count.
XLA_IMPLEMENTATIONS = {"index_scores": "xla", "gathered_index_scores": "xla",
                       "sparse_attention": "xla", "grouped_matmul": "xla_tiles"}
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    target: str
    part: str  # "moe" | "slice"
    step: str  # "prefill" | "decode"
    indexer: str
    experts: str  # "bf16" | "fp8"


def model_config(args, case):
    config = get_config(case.model)
    config = keep_layers(config, list(args.layers)) if case.part == "slice" else config
    config = config.replace(max_seq_len=args.context, prefill_chunk=args.chunk,
                            attention="sparse")
    if case.part == "slice":
        config = config.replace(indexer=case.indexer)
    if case.experts == "fp8":
        config = config.replace(moe=config.moe.replace(fp8_block=FP8_BLOCK))
    return config


def step_program(config, case, context, chunk):
    """(lower(place) -> jax Lowered, model.costs' chunk) of one step (GpuTarget.compile)."""
    if case.part == "moe":
        dtype, pdtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(
            config.d_model, config.moe, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=pdtype)))
        fn = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
        args = (state, jax.ShapeDtypeStruct((chunk, config.d_model), dtype))
        return (lambda place: fn.trace(*place(args)).lower()), None
    runner = ModelRunner.abstract(config)
    cache = jax.eval_shape(lambda: init_cache(config, context))
    T = chunk if case.step == "prefill" else 1
    tokens = jax.ShapeDtypeStruct((T,), jnp.int32)
    return (lambda place: runner.lower_step(tokens, cache, context - T, context, T,
                                            place=place)), Chunk(0, context - T, T, T, context)


def expert_work(config, chunk):
    """The grouped matmul's rows (whole tiles per expert) over the routed rows, for a chunk
    of random tokens through a random router (near-uniform routing), and its bound."""
    moe = config.moe
    E, k = moe.n_routed_experts, moe.num_experts_per_tok
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (chunk, config.d_model), jnp.float32)
    router = nnx.initializers.lecun_normal()(keys[1], (E, config.d_model), jnp.float32)
    _, experts = route(x, router, jnp.zeros((E,), jnp.float32), moe)
    sizes = np.bincount(np.asarray(experts).reshape(-1), minlength=E)
    bm = rows_per_tile(chunk * k, E)
    return {"block_m": bm, "routed_rows": int(sizes.sum()),
            "tile_rows": tile_work(sizes, bm),
            "ratio": tile_work(sizes, bm) / sizes.sum(),
            "bound": 1 + E * (bm - 1) / (chunk * k)}


def dense_buffers(dump_dir, rows, experts):
    """Temporaries whose shape has both the assignment-row and the expert axis."""
    from experiments.benchmarks.hlo_report import dump_files

    _, assignment = dump_files(dump_dir)
    out = []
    for size, inst, shape in temp_buffers(assignment):
        arrays = re.findall(r"\[([0-9,]*)\]", shape)
        if any(rows in dims and experts in dims
               for dims in ([int(d) for d in a.split(",") if d] for a in arrays)):
            out.append({"bytes": size, "shape": shape, "instruction": inst})
    return out


def costs_flops(config, chunk):
    """model.costs' FLOPs of one step (every masked entry computed, as XLA's plain
    implementations do), without its dense-attention comparison stage."""
    counts = prefill_counts(config, chunk.position + chunk.length, skip=False,
                            chunks=[chunk])
    totals = counts.total().totals()
    return sum(v["flops"] for stage, v in totals.items() if stage != "dense_attention")


def run_case(args, case):
    target = gpu_target(case.target)
    config = model_config(args, case)
    lower, chunk = step_program(config, case, args.context, args.chunk)
    with tempfile.TemporaryDirectory() as dump:
        compiled, seconds = target.compile(lower, implementations=args.use, dump_dir=dump)
        m = compiled.memory_analysis()
        largest = largest_temporaries(dump)
        row = dataclasses.asdict(case) | {
            "context": args.context, "chunk": args.chunk if case.step == "prefill" else 1,
            "layers": list(args.layers) if case.part == "slice" else None,
            "temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
            "output_bytes": m.output_size_in_bytes, "alias_bytes": m.alias_size_in_bytes,
            "compile_s": round(seconds, 1), "largest": largest}
        if case.part == "moe":
            E, k = config.moe.n_routed_experts, config.moe.num_experts_per_tok
            row["dense_buffers"] = dense_buffers(dump, args.chunk * k, E)
    row["peak_bytes"] = peak_bytes(compiled)
    row["device_bytes"] = target.memory_bytes
    row["fits"] = row["peak_bytes"] <= args.utilization * target.memory_bytes
    text = compiled.as_text()
    row["kernels"] = sorted(set(_kernel_names(text)))
    with target.compiling(), pallas_kernels.use_implementations(**(args.use or {})):
        row["implementations"] = {op: pallas_kernels.resolve(op) for op in pallas_kernels.OPS}
    if case.part == "moe" and case.step == "prefill":
        row["expert_work"] = expert_work(config, args.chunk)
    if args.xla_flops and chunk is not None:
        xla, seconds = target.compile(lower, implementations=XLA_IMPLEMENTATIONS)
        counted = DotFlops(xla.as_text())
        row["xla_flops"] = counted.total
        row["costs_flops"] = costs_flops(config, chunk)
        row["flops_ratio"] = row["xla_flops"] / row["costs_flops"]
        row["uncounted"] = {"custom_calls": counted.custom_calls,
                            "unknown_trip_counts": counted.unknown_trip_counts}
    return row


def _kernel_names(text):
    for m in re.finditer(r'custom_call_target="([^"]*)"', text):
        yield m.group(1)
    for m in re.finditer(r'"name":"([\w\-]+)"', text):  # Triton kernels' names
        yield "triton:" + m.group(1)


def markdown(rows, command):
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    lines = [f"`{command}`", "",
             "| model | target | part | step | indexer | experts | grouped matmul | temp GiB "
             "| args GiB | peak GiB | fits | largest temporary (op) | compile s |",
             "|---|---|---|---|---|---|---|---:|---:|---:|---|---|---:|"]
    for r in rows:
        big = r["largest"][0] if r["largest"] else None
        where = f"{gib(big['bytes'])} GiB {big['shape']} ({big['op'] or big['instruction']})" \
            if big else "-"
        lines.append(f"| {r['model']} | {r['target']} | {r['part']} | {r['step']} | "
                     f"{r['indexer']} | {r['experts']} | "
                     f"{r['implementations']['grouped_matmul']} | {gib(r['temp_bytes'])} | "
                     f"{gib(r['argument_bytes'])} | {gib(r['peak_bytes'])} | "
                     f"{'yes' if r['fits'] else 'NO'} | {where} | {r['compile_s']} |")
    work = [r for r in rows if "expert_work" in r]
    if work:
        lines += ["", "| model | target | experts | dense buffers | block_m | tile rows / "
                  "routed rows | bound |", "|---|---|---|---|---:|---:|---:|"]
        for r in work:
            w = r["expert_work"]
            lines.append(f"| {r['model']} | {r['target']} | {r['experts']} | "
                         f"{len(r['dense_buffers'])} | {w['block_m']} | {w['ratio']:.3f} | "
                         f"{w['bound']:.3f} |")
    flops = [r for r in rows if "xla_flops" in r]
    if flops:
        lines += ["", "| model | target | experts | step | indexer | XLA dot TFLOP | "
                  "model.costs TFLOP | ratio |", "|---|---|---|---|---|---:|---:|---:|"]
        for r in flops:
            lines.append(f"| {r['model']} | {r['target']} | {r['experts']} | {r['step']} | "
                         f"{r['indexer']} | "
                         f"{r['xla_flops'] / 1e12:.3f} | {r['costs_flops'] / 1e12:.3f} | "
                         f"{r['flops_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def _list(choices):
    def parse(text):
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"choose from {list(choices)}, got {text!r}")
        return values
    return parse


def _use(text):
    out = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
    for op, impl in out.items():
        if op not in pallas_kernels.OPS or impl not in pallas_kernels.OPS[op].implementations:
            raise argparse.ArgumentTypeError(
                f"--use: {op}={impl} is not an op and one of its implementations: "
                + "; ".join(f"{o}: {sorted(v.implementations)}"
                            for o, v in pallas_kernels.OPS.items()))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.benchmarks.gpu_compile",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=_list(tuple(TARGETS)), default=["h100", "h200"])
    p.add_argument("--model", type=_list(MODELS), default=list(MODELS))
    p.add_argument("--parts", type=_list(("moe", "slice")), default=["moe", "slice"])
    p.add_argument("--layers", default="2,3,4,5",
                   type=lambda t: tuple(int(x) for x in t.split(",")),
                   help="the slice's layers (default 2,3,4,5: the last dense + 3 MoE)")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--indexers", type=_list(("flat", "hierarchical")),
                   default=["flat", "hierarchical"])
    p.add_argument("--steps", type=_list(("prefill", "decode")), default=["prefill", "decode"])
    p.add_argument("--experts", type=_list(("bf16", "fp8")), default=["bf16", "fp8"])
    p.add_argument("--use", type=_use, default={}, metavar="OP=IMPL,...")
    p.add_argument("--xla-flops", action="store_true")
    p.add_argument("--utilization", type=float, default=0.9)
    p.add_argument("--check", type=float, default=None, metavar="GIB",
                   help="exit 1 when a row does not fit, has a buffer with both the "
                        "assignment-row and expert axes, or a temporary larger than GIB")
    add_out_argument(p, NAME)
    args = p.parse_args(argv)
    if not 0 < args.utilization <= 1:
        p.error(f"--utilization must be in (0, 1], got {args.utilization}")
    if args.context < 1 or args.chunk < 1 or args.chunk > args.context:
        p.error(f"--chunk must be in [1, --context]; got chunk {args.chunk}, context "
                f"{args.context}")
    return args


def cases(args):
    for model in args.model:
        for target in args.target:
            for experts in args.experts:
                if "moe" in args.parts:
                    yield Case(model, target, "moe", "prefill", "-", experts)
                if "slice" in args.parts:
                    for step in args.steps:
                        for indexer in args.indexers:
                            yield Case(model, target, "slice", step, indexer, experts)


def main(argv=None):
    args = parse_args(argv)
    command = recorded_command("experiments.benchmarks.gpu_compile", argv)
    rows = []
    out = pathlib.Path(args.out)
    for case in cases(args):
        row = run_case(args, case)
        rows.append(row)
        print(f"{case.model} {case.target} {case.part} {case.step} {case.indexer} "
              f"{case.experts}: temp {row['temp_bytes'] / GIB:.2f} GiB, peak "
              f"{row['peak_bytes'] / GIB:.2f} GiB of {row['device_bytes'] / GIB:.1f}, fits "
              f"{row['fits']}, compile {row['compile_s']} s"
              + (f", XLA/costs FLOPs {row['flops_ratio']:.3f}" if "flops_ratio" in row else ""),
              flush=True)
        write_json(out / "gpu_compile.json", {"command": command, "jax": jax.__version__,
                                              "rows": rows})
    (out / "gpu_compile.md").write_text(markdown(rows, command))
    print(markdown(rows, command))
    if args.check is not None:
        failures = check(rows, args.check)
        for failure in failures:
            print("FAIL:", failure)
        if failures:
            raise SystemExit(1)
        print(f"check passed: {len(rows)} rows fit, no dense expert buffer, no temporary "
              f"over {args.check} GiB")
    return rows


def check(rows, max_temp_gib):
    """What --check refuses, one line per failing row."""
    failures = []
    for r in rows:
        what = f"{r['model']} {r['target']} {r['part']} {r['step']} {r['indexer']} {r['experts']}"
        biggest = max((b["bytes"] for b in r["largest"]), default=0)
        if not r["fits"]:
            failures.append(f"{what}: peak {r['peak_bytes'] / GIB:.2f} GiB does not fit")
        if r.get("dense_buffers"):
            failures.append(f"{what}: dense expert buffers {r['dense_buffers']}")
        if biggest > max_temp_gib * GIB:
            failures.append(f"{what}: a temporary of {biggest / GIB:.2f} GiB "
                            f"({r['largest'][0]['op'] or r['largest'][0]['instruction']})")
    return failures


if __name__ == "__main__":
    main()
