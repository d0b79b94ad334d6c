"""dosa's main job: time to first token of flat vs hierarchical selection, side by side.

    python -m experiments.run [--config experiments/configs/run_default.yaml] [--out DIR]
        [--set key.path=value ...] [--mesh sequence=4,tensor=2]
        [--coordinator-address HOST:PORT --num-processes N --process-id I]
    python -m experiments.run --config experiments/configs/run_gpu.yaml \
        --compile-only --target h100|h200 [--out DIR]

For every context length and mode of the config (default: the shipped `small` checkpoint on
held-out real text; sparse-flat and sparse-hierarchical at 8K, 16K and 32K, dense up to
8K): TTFT (min, median and max over the timed repetitions after a compile-only warm-up,
the modes and split baselines of a length interleaved; ratios from the min), the
prefill split into indexer / attention / other with the indexer's share, the decode step
time, and the fidelity of each mode against the reference (recall and IoU of the selection,
greedy top-1 agreement and logit KL over the last positions, vs flat and vs dense). Writes
OUT/results.json, OUT/report.md and OUT/ttft.png (default OUT: runs/run/); prints a table.
Other configs: experiments/configs/run_*.yaml (longer CPU run, ablations, one H200).

Every program is compiled once (experiments.ttft.plan: one cache capacity for every length,
so a shorter prefill's chunks are a longer one's first), before the first length that runs
it is timed; the XLA compiles of each length are counted and printed (0 while timed).
--compile-only --target: no device, no weights; every program of the config compiled for
that GPU here (the `cuda12` extra, docs/gpus.md), printed with its compile seconds and peak
memory against the device's memory x 0.9; writes OUT/compile_only.json.
"""

import argparse
import pathlib
import sys
import time

import jax
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from experiments.common import add_out_argument, enable_compile_cache, recorded_command, write_json
from experiments.gpu_targets import TARGETS
from experiments.schema import ConfigError
from experiments.ttft.config import load_run_config
from experiments.ttft.plan import plan_length
from experiments.ttft.projection import projection
from experiments.ttft.report import console_lines, markdown, plot
from experiments.ttft.study import METHOD, environment, load_source, run_study, source_config
from model import CheckpointMissingError
from model.parallel_flags import add_parallel_arguments
from model.sharding import check_mesh, mesh_from_args, use_mesh

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "run_default.yaml"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="run config YAML (default experiments/configs/run_default.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config entry, e.g. --set lengths=[4096] (repeatable)")
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="a pretrained model (e.g. smollm2-135m) or a .gguf / HF folder: "
                        "shorthand for --set model.pretrained=NAME")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every program of the config for --target here, run nothing")
    p.add_argument("--target", choices=sorted(TARGETS), default=None,
                   help="the GPU --compile-only compiles for")
    add_parallel_arguments(p)  # --mesh, --coordinator-address, --num-processes, --process-id
    add_out_argument(p, "run")
    args = p.parse_args(argv)
    if args.compile_only != (args.target is not None):
        p.error("--compile-only and --target go together")
    if args.compile_only and args.mesh:
        p.error("--compile-only compiles for one GPU: drop --mesh")
    if args.model is not None:
        args.set = [f"model.pretrained={args.model}", *args.set]
    try:
        run = load_run_config(args.config, args.set)
    except FileNotFoundError:
        p.error(f"--config {args.config}: no such file")
    except ValueError as e:  # ConfigError and bad --set syntax
        p.error(f"--config {args.config}: {e}")
    return p, args, run


def compile_only(p, args, run, argv):
    """Every program of the study compiled for args.target here -> the JSON payload."""
    jax.config.update("jax_platforms", "cpu")  # before any backend: the deviceless compile
    from experiments.gpu_targets import gpu_target
    from experiments.ttft.plan import GIB, rehearse

    try:
        config, description = source_config(run.model, max(run.lengths) + run.decode_steps + 1)
        target = gpu_target(args.target)
    except (ValueError, ConfigError, CheckpointMissingError, RuntimeError) as e:
        p.error(f"model: {e}" if not isinstance(e, RuntimeError) else str(e))
    print(f"compiling {description}, lengths {list(run.lengths)}, modes "
          f"{[m.name for m in run.modes]}, for {target.device_kind}", flush=True)
    try:
        plan_length(run, config, max(run.lengths))
    except ValueError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    report = rehearse(run, config, target, log=lambda line: print(line, flush=True))
    s = report["summary"]
    print(f"{s['executables']} executables, each compiled once, {s['compile_s']} s of "
          f"compiles; peak {s['peak_bytes'] / GIB:.2f} GiB, with what the study holds beside "
          f"it {s['held_bytes'] / GIB:.2f} GiB, of {s['device_bytes'] / GIB:.1f} GiB (fit "
          f"x 0.9: {s['fits']}, with what is held: {s['fits_with_held']})")
    payload = {"config": run.to_dict(), "model": description, "jax": jax.__version__,
               "command": recorded_command("experiments.run", argv),
               "wall_s": round(time.perf_counter() - t0, 1), **report}
    write_json(pathlib.Path(args.out) / "compile_only.json", payload)
    return payload


def main(argv=None):
    p, args, run = parse_args(argv)
    if args.compile_only:
        return compile_only(p, args, run, argv)
    try:  # jax.distributed first: no other JAX call may come before it
        mesh = mesh_from_args(args)
    except ValueError as e:
        p.error(str(e))
    lead = jax.process_index() == 0  # with several processes, process 0 reports
    # A pipe or log file gets the whole table, not 80 columns of it.
    console = Console(width=None if sys.stdout.isatty() else 200)
    enable_compile_cache()
    try:
        model, description, random_weights, heldout = load_source(
            run.model, max(run.lengths) + run.decode_steps + 1)
    except CheckpointMissingError as e:
        p.error(str(e))
    except (ValueError, ConfigError) as e:
        p.error(f"model: {e}")
    if mesh is not None:
        try:
            check_mesh(model.config, mesh)
        except ValueError as e:
            p.error(str(e))
    for spec in run.modes:  # bad mode fields fail before any measurement
        try:
            spec.model_config(model.config)
        except ValueError as e:
            p.error(f"modes: {spec.name}: {e}")
    try:
        plan_length(run, model.config, max(run.lengths))
    except ValueError as e:
        p.error(str(e))
    console.print(f"dosa TTFT study: {description}; lengths {list(run.lengths)}; modes "
                  f"{[m.name for m in run.modes]}; {run.repetitions} timed prefills each")
    if random_weights:
        console.print("[bold]random weights[/bold]: timing only, no fidelity figures")
    total = sum(1 for L in run.lengths for m in run.modes
                if m.max_length is None or L <= m.max_length)
    t0 = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total} runs"), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("starting", total=total)
        started = []

        def progress(description, advance=True):
            if started and advance:
                bar.advance(task)
            if advance:
                started.append(description)
            bar.update(task, description=description)
            if not console.is_terminal:  # a log file gets each step, timed, not a bar
                console.print(f"[{time.perf_counter() - t0:7.1f} s] {description}")

        with use_mesh(mesh):  # every runner of the study runs on the mesh
            rows, summary = run_study(run, model, heldout, random_weights=random_weights,
                                      progress=progress, log=console.print)
        bar.update(task, completed=total, description="done")
    command = recorded_command("experiments.run", argv)
    results = {"config": run.to_dict(), "model": description, "random_weights": random_weights,
               "env": environment(), "method": METHOD, "runs": rows, "summary": summary,
               "projection": projection() if lead else None,
               "command": command, "wall_s": time.perf_counter() - t0,
               "mesh": None if mesh is None else dict(mesh.shape),
               "processes": jax.process_count()}
    if not lead:
        return results
    out = pathlib.Path(args.out)
    write_json(out / "results.json", results)
    (out / "report.md").write_text(markdown(results))
    plot(results, out / "ttft.png")
    for line in console_lines(results):
        console.print(escape(line), soft_wrap=True)
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'ttft.png'} "
                  f"({results['wall_s']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
