"""The prepared GPU run: what a session lent one H100 or H200 runs, once, in one call.

    python -m experiments.gpu_run [--out DIR] [--steps kernels,v32,small]   # on the GPU
    python -m experiments.gpu_run --compile-only --target h100|h200 [--out DIR]   # rehearsal

Steps in priority order, each a child process under its own timeout (what a step wrote
before its timeout is kept; the next step runs either way), 285 s in all on the GPU (the
rehearsal compiles on 2 CPU cores: 600 s in all):

- kernels (60 s; rehearsal 60 s): `pallas_kernels.bench --sections correctness`, every
  kernel against its reference on fresh inputs, every grouped-matmul implementation the
  GPU runs (bf16 and FP8 blocks); rehearsed with the kernels interpreted (`--smoke`).
- v32 (150 s; rehearsal 330 s): `experiments.benchmarks.gpu_ttft --model deepseek-v3.2`,
  the V3.2 slice (layers 2-5, true dimensions, random weights; FP8 experts where bf16
  would take over half the device: an H100), prefill TTFT flat vs hierarchical at 32K /
  64K / 128K, recall against flat, two decode steps; rehearsed by compiling every one of
  its executables for the target (count, compile seconds, peak memory).
- small (75 s; rehearsal 210 s): the same for the `small` model in chunks of 4096 (its
  own 1024 would double the executables), without the recall.

On the GPU the run ends by putting each measured peak memory beside the rehearsal's
prediction for the same steps (`--predictions`, default results/gpu/rehearsal_<target>,
the target named by the device). The parent process never starts JAX on the GPU: each
child may take 90% of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION, serving's
GPU_UTILIZATION default). Writes OUT/gpu_run.json (device, versions, command, each step's
exit, seconds, whether it timed out) and each step's folder and log; OUT defaults to
results/gpu/<today>/ (on the device: `--out $OUT`; docs/gpus.md has the call).
"""

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import time

from experiments.common import recorded_command, write_json


@dataclasses.dataclass(frozen=True)
class Step:
    """on_gpu / rehearsal: the arguments after `python -m`; the rehearsal compiles on this
    2-core machine, hence its own, longer timeout."""

    name: str
    timeout_s: int
    on_gpu: tuple
    rehearsal: tuple
    rehearsal_timeout_s: int


SMALL = ("--chunk", "4096", "--no-recall")
STEPS = (
    Step("kernels", 60,
         ("pallas_kernels.bench", "--sections", "correctness"),
         ("pallas_kernels.bench", "--smoke", "--sections", "correctness"), 60),
    Step("v32", 150,
         ("experiments.benchmarks.gpu_ttft", "--model", "deepseek-v3.2"),
         ("experiments.benchmarks.gpu_ttft", "--model", "deepseek-v3.2", "--compile-only"),
         330),
    # The small model's own 1024-token chunks would double its executables.
    Step("small", 75,
         ("experiments.benchmarks.gpu_ttft", "--model", "small", *SMALL),
         ("experiments.benchmarks.gpu_ttft", "--model", "small", *SMALL, "--compile-only"),
         210),
)
TARGET_OF_DEVICE = {"H100": "h100", "H200": "h200", "A100": "a100"}


def versions():
    out = {"python": sys.version.split()[0]}
    for name in ("jax", "jaxlib", "flax", "tokamax", "jax-triton", "triton"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_name():
    """The GPU's name from nvidia-smi (the parent must not start JAX on the GPU), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_step(step, args, out):
    """Runs one step as a child process under its timeout -> its record."""
    command = list(step.rehearsal if args.compile_only else step.on_gpu)
    command += ["--out", str(out / step.name)]
    if args.compile_only and step.name != "kernels":
        command += ["--target", args.target]
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.9")
    if args.compile_only:
        env["JAX_PLATFORMS"] = "cpu"
    log = out / f"{step.name}.log"
    limit = step.rehearsal_timeout_s if args.compile_only else step.timeout_s
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", *command], stdout=f,
                                stderr=subprocess.STDOUT, env=env,
                                timeout=limit).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    seconds = round(time.perf_counter() - t0, 1)
    scrub(log)
    print(f"{step.name}: {'timed out' if timed_out else f'exit {rc}'} after {seconds} s "
          f"(limit {limit} s); log {log.name}", flush=True)
    return {"step": step.name, "command": "python -m " + " ".join(command), "exit": rc,
            "timed_out": timed_out, "seconds": seconds, "timeout_s": limit}


def scrub(log):
    """No machine paths in a result: the interpreter's prefix and the checkout become
    <python> and '.' in a step's log."""
    text = log.read_text(errors="replace")
    for path, name in ((sys.prefix, "<python>"), (str(pathlib.Path.cwd()), ".")):
        text = text.replace(path, name)
    log.write_text(text)


def predictions(records, out, predictions_dir):
    """Measured peak memory of each gpu_ttft step beside the rehearsal's prediction."""
    rows = []
    for step in ("v32", "small"):
        measured = out / step / "gpu_ttft.json"
        predicted = pathlib.Path(predictions_dir) / step / "gpu_ttft.json"
        if not measured.exists() or not predicted.exists():
            continue
        m, p = json.loads(measured.read_text()), json.loads(predicted.read_text())
        rows.append({"step": step, "measured_peak_bytes": m.get("peak_bytes_in_use"),
                     "predicted_peak_bytes": p["compile_only"]["peak_bytes"],
                     "measured_executables": m.get("executables"),
                     "predicted_executables": p["compile_only"]["executables"],
                     "measured_compile_s": m.get("compile_s"),
                     "rehearsal_compile_s": p["compile_only"]["compile_s"]})
        print(f"{step}: peak {rows[-1]['measured_peak_bytes']} bytes measured, "
              f"{rows[-1]['predicted_peak_bytes']} predicted", flush=True)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default=",".join(s.name for s in STEPS))
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--target", choices=("a100", "h100", "h200"), default=None)
    p.add_argument("--predictions", default=None, metavar="DIR",
                   help="the rehearsal to compare with (default results/gpu/rehearsal_<target>)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="default results/gpu/<today>/ (rehearsal: results/gpu/rehearsal_<target>)")
    args = p.parse_args(argv)
    if args.compile_only != (args.target is not None):
        p.error("--compile-only and --target go together")
    names = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(names) - {s.name for s in STEPS})
    if unknown or not names:
        p.error(f"--steps must name some of {[s.name for s in STEPS]}, got {args.steps!r}")
    args.steps = names
    if args.out is None:
        args.out = (f"results/gpu/rehearsal_{args.target}" if args.compile_only else
                    f"results/gpu/{datetime.date.today().isoformat()}")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = None if args.compile_only else gpu_name()
    target = args.target or next((t for k, t in TARGET_OF_DEVICE.items()
                                  if device and k in device), None)
    report = {"command": recorded_command("experiments.gpu_run", argv), "device": device,
              "target": target, "compile_only": args.compile_only, "versions": versions(),
              "steps": []}
    t0 = time.perf_counter()
    for step in STEPS:
        if step.name in args.steps:
            report["steps"].append(run_step(step, args, out))
            write_json(out / "gpu_run.json", report)
    if not args.compile_only and target:
        report["predictions"] = predictions(
            report["steps"], out, args.predictions or f"results/gpu/rehearsal_{target}")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(out / "gpu_run.json", report)
    print(f"done in {report['seconds']} s: {out}")
    return report


if __name__ == "__main__":
    main()
