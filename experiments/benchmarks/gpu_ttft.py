"""Prefill TTFT flat vs hierarchical on one GPU, every executable compiled once; or, with
--compile-only --target, every one of those executables compiled for that GPU here.

    python -m experiments.benchmarks.gpu_ttft [--model deepseek-v3.2|glm-5|small] \\
        [--layers 2,3,4,5] [--experts auto|bf16|fp8] [--lengths 32768,65536,131072] \\
        [--repeats 2] [--decode-steps 2] [--fidelity-positions 256] [--no-recall] \\
        [--chunk N] \\
        [--compile-only --target h100|h200] [--out DIR]

Random weights (timing only: the recall is a check of the plumbing, not of fidelity),
random tokens. Every length prefills into one cache of max(lengths) positions, so the
chunks a shorter prefill runs are the first chunks of a longer one and share their
executables: the steps compiled are the distinct (chunk rows, keys read, capture) shapes
of all lengths, for flat and for hierarchical, plus one decode step each. Their count is
recorded with the XLA compiles counted (jax.monitoring) before the timing and while timed
(0 when every executable was compiled once). A prefill of L tokens runs L -
decode_steps - 1 of them, so the decode steps after the longest (and one untimed step
before them) fit the cache. Modes are timed interleaved (flat, hierarchical, per
repetition); the flat pass captures its last `--fidelity-positions` queries' indexer
inputs and selections (the hierarchical pass captures the same, so both carry the same
transfers), and hierarchical selection on flat's inputs gives the recall against flat.
--experts auto keeps the routed experts in bf16 where the slice's weights take at most
half the device, else FP8 (an H100 for the V3.2 slice).

--compile-only --target: no device; the same executables compiled by experiments.gpu_targets,
printed with their compile seconds and peak bytes (arguments + temporaries + outputs not
aliased) against the target's memory x 0.9: the rehearsal of the prepared GPU run
(experiments.gpu_run), and its prediction of each step's memory.
Writes OUT/gpu_ttft.json (default runs/gpu_ttft/).
"""

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import CompileCounter, add_out_argument, recorded_command, write_json
from model import ModelRunner, Transformer, with_config
from model.config import keep_layers
from model.presets import get_config
from model.runner import step_key

NAME = "gpu_ttft"
MODES = ("flat", "hierarchical")
# Both modes' timed passes capture their last queries' indexer inputs and selections (the
# same transfers in both); flat's give the recall of hierarchical selection on them.
CAPTURE = ("indexer", "indices")


def capture_kinds(args):
    return CAPTURE if args.recall else ()
GIB = 1 << 30


def base_config(args, experts):
    config = get_config(args.model)
    if args.model != "small":
        config = keep_layers(config, list(args.layers))
    config = config.replace(max_seq_len=max(args.lengths), attention="sparse", indexer="flat",
                            prefill_chunk=args.chunk or config.prefill_chunk)
    if experts == "fp8":
        config = config.replace(moe=config.moe.replace(fp8_block=(128, 128)))
    return config


def choose_experts(args, device_bytes):
    """bf16 unless the weights would take more than half the device (then FP8)."""
    if args.experts != "auto" or args.model == "small":
        return "bf16" if args.experts == "auto" else args.experts
    from model.memory import param_bytes_per_device

    weights, _ = param_bytes_per_device(base_config(args, "bf16"), {})
    return "bf16" if weights <= 0.5 * device_bytes else "fp8"


def prefilled(length, decode_steps):
    """Tokens a prefill of `length` runs: room is left for the decode steps (and the untimed
    first one) in a cache of the longest length."""
    return length - decode_steps - 1


def distinct_steps(runner, args):
    """{step_key: lower_step's arguments} of every prefill of the run (one cache of the
    longest length) and of the decode steps after the longest."""
    cap, d, P, kinds = max(args.lengths), args.decode_steps, args.fidelity_positions, \
        capture_kinds(args)
    steps = {}
    for L in args.lengths:
        n = prefilled(L, d)
        for step in runner.prefill_steps(n, capacity=cap, capture=kinds,
                                         capture_from=n - P if kinds else None):
            steps.setdefault(step_key(step), step)
    n = prefilled(cap, d)
    for step in runner.decode_steps(range(n, n + d + 1), cap):
        steps.setdefault(step_key(step), step)
    return steps


def rehearse(args):
    """--compile-only: compile every step for the target here -> the JSON payload."""
    from experiments.gpu_targets import gpu_target, peak_bytes

    target = gpu_target(args.target)
    experts = choose_experts(args, target.memory_bytes)
    rows = []
    for mode in MODES:
        config = base_config(args, experts).replace(indexer=mode)
        runner = ModelRunner.abstract(config)
        for key, step in sorted(distinct_steps(runner, args).items(),
                                key=lambda kv: (kv[0][1], kv[0][0], kv[0][2:])):
            compiled, seconds = target.compile(
                lambda place, step=step, runner=runner: runner.lower_step(*step, place=place))
            m, peak = compiled.memory_analysis(), peak_bytes(compiled)
            padded, kv_len, _, kinds = key
            rows.append({"mode": mode, "rows": padded, "kv_len": kv_len,
                         "capture": list(kinds), "compile_s": round(seconds, 1),
                         "temp_bytes": m.temp_size_in_bytes, "peak_bytes": peak})
            print(f"{mode:>12} step rows {padded:>5} keys {kv_len:>7} capture {list(kinds)}: "
                  f"compile {seconds:5.1f} s, temp {m.temp_size_in_bytes / GIB:.2f}"
                  f" GiB, peak {peak / GIB:.2f} GiB", flush=True)
    peak = max(r["peak_bytes"] for r in rows)
    summary = {"target": args.target, "experts": experts, "executables": len(rows),
               "compile_s": round(sum(r["compile_s"] for r in rows), 1), "peak_bytes": peak,
               "device_bytes": target.memory_bytes,
               "fits": peak <= 0.9 * target.memory_bytes}
    print(f"{len(rows)} executables for {args.target}, {summary['compile_s']} s of compiles, "
          f"peak {peak / GIB:.2f} GiB of {target.memory_bytes / GIB:.1f} (fits x 0.9: "
          f"{summary['fits']})")
    return {"compile_only": summary, "steps": rows}


def measure(args, save):
    """On the device: compile, time interleaved, recall, decode -> the JSON payload;
    save(payload) after each length (a step stopped by its timeout keeps what finished)."""
    from experiments.evaluation.metrics import selection_metrics, selections_on_captured
    from model.memory import device_memory_bytes

    device = jax.devices()[0]
    experts = choose_experts(args, device_memory_bytes() or 0)
    config = base_config(args, experts)
    t0 = time.perf_counter()
    model = Transformer(config, rngs=nnx.Rngs(0))
    runners = {"flat": ModelRunner(model),
               "hierarchical": ModelRunner(with_config(model, config.replace(
                   indexer="hierarchical")))}
    init_s = time.perf_counter() - t0
    cap, P, d = max(args.lengths), args.fidelity_positions, args.decode_steps
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, cap).astype(np.int32)
    kinds = capture_kinds(args)
    steps = {m: distinct_steps(r, args) for m, r in runners.items()}
    compiles = CompileCounter()
    t0 = time.perf_counter()
    for L in args.lengths:
        for runner in runners.values():
            n = prefilled(L, d)
            runner.compile_prefill(n, capacity=cap, capture=kinds,
                                   capture_from=n - P if kinds else None)
    for runner in runners.values():  # the cache's own small fill programs
        runner.new_cache(cap)
    for padded in {key[0] for keys in steps.values() for key in keys}:  # token uploads
        jnp.asarray(np.zeros(padded, np.int32)).block_until_ready()
    compile_s = time.perf_counter() - t0
    # The decode steps compile on their first (untimed) call.
    expected = sum(map(len, steps.values())) - len(runners)
    compiled = compiles.take()
    print(f"weights ({experts} experts) {init_s:.1f} s; {compiled} backend compiles ("
          f"{expected} prefill steps, the rest the cache's and the tokens' small programs) in "
          f"{compile_s:.1f} s", flush=True)
    rows = []
    payload = {"device": device.device_kind, "experts": experts, "init_s": round(init_s, 1),
               "executables": sum(map(len, steps.values())),
               "backend_compiles": {"before_timing": compiled}, "compile_s": round(compile_s, 1),
               "rows": rows}
    for L in args.lengths:
        n = prefilled(L, d)
        times, outs = {m: [] for m in runners}, {}
        for _ in range(args.repeats):
            for mode, runner in runners.items():
                start = time.perf_counter()
                out = runner.prefill(tokens[:n], capacity=cap, capture=kinds,
                                     capture_from=n - P if kinds else None)
                int(np.argmax(np.asarray(out[0])))
                times[mode].append(1000 * (time.perf_counter() - start))
                outs[mode] = out
        compiled_while_timed = compiles.take()
        row = {"length": n, "flat_ms": min(times["flat"]),
               "hierarchical_ms": min(times["hierarchical"]), "runs_ms": times,
               "recall": None, "iou": None}
        if kinds:
            flat_out = outs["flat"]
            hier = selections_on_captured(runners["hierarchical"].config, flat_out[2],
                                          flat_out[1], n - P, n)
            sel = selection_metrics(np.asarray(flat_out[2]["indices"]), hier)
            row |= {"recall": sel["recall_mean"], "iou": sel["iou_mean"]}
        row["flat_over_hierarchical"] = row["flat_ms"] / row["hierarchical_ms"]
        row["backend_compiles_while_timed"] = compiled_while_timed
        if L == cap and d:
            row["decode_ms"] = {m: decode_times(r, outs[m], n, d) for m, r in runners.items()}
        rows.append(row)
        recall = "" if row["recall"] is None else f", recall {row['recall']:.3f}"
        print(f"{n:>7} tokens: flat {row['flat_ms']:.1f} ms, hierarchical "
              f"{row['hierarchical_ms']:.1f} ms ({row['flat_over_hierarchical']:.2f}x){recall}",
              flush=True)
        outs.clear()
        compiles.take()  # the recall's and decode's own programs
        stats = device.memory_stats() or {}
        payload |= {"peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                    "bytes_limit": stats.get("bytes_limit")}
        save(payload)
    return payload


def decode_times(runner, out, n, steps):
    """ms of each greedy decode step after the prefill `out` of n tokens (first untimed:
    it may compile)."""
    cache, token, times = out[1], int(np.argmax(np.asarray(out[0]))), []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        logits, cache = runner.decode(token, cache, n + i)
        token = int(np.argmax(np.asarray(logits)))
        if i:
            times.append(1000 * (time.perf_counter() - t0))
    return times


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.benchmarks.gpu_ttft",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("deepseek-v3.2", "glm-5", "small"),
                   default="deepseek-v3.2")
    p.add_argument("--layers", default="2,3,4,5",
                   type=lambda t: tuple(int(x) for x in t.split(",")))
    p.add_argument("--experts", choices=("auto", "bf16", "fp8"), default="auto")
    p.add_argument("--lengths", default="32768,65536,131072",
                   type=lambda t: sorted(int(x) for x in t.split(",")))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-steps", type=int, default=2)
    p.add_argument("--fidelity-positions", type=int, default=256)
    p.add_argument("--no-recall", dest="recall", action="store_false",
                   help="capture nothing: no recall, fewer executables")
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk (default: the model's prefill_chunk)")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--target", choices=("a100", "h100", "h200"), default=None)
    add_out_argument(p, NAME)
    args = p.parse_args(argv)
    if args.compile_only != (args.target is not None):
        p.error("--compile-only and --target go together")
    if args.repeats < 1 or args.decode_steps < 0:
        p.error("--repeats must be >= 1 and --decode-steps >= 0")
    if min(args.lengths) <= args.decode_steps + args.fidelity_positions:
        p.error(f"--lengths must each exceed --decode-steps + --fidelity-positions "
                f"({args.decode_steps + args.fidelity_positions}), got {args.lengths}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.compile_only:  # before JAX starts a backend: the deviceless compile runs on CPU
        jax.config.update("jax_platforms", "cpu")
    payload = {"command": recorded_command("experiments.benchmarks.gpu_ttft", argv),
               "jax": jax.__version__, "model": args.model,
               "layers": list(args.layers) if args.model != "small" else None,
               "lengths": args.lengths}
    path = pathlib.Path(args.out) / "gpu_ttft.json"
    save = lambda part: write_json(path, payload | part)  # noqa: E731
    payload |= rehearse(args) if args.compile_only else measure(args, save)
    write_json(path, payload)
    return payload


if __name__ == "__main__":
    main()
