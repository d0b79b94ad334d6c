"""dosa's prefill beside llama.cpp's, same GGUF, same tokens, same machine, interleaved.

    python -m experiments.benchmarks.peer_prefill [--lengths 4096,8192,16384,32768]
        [--modes sparse-flat,sparse-hierarchical,dense] [--rounds 1] [--out DIR]

The peer is llama.cpp through llama-cpp-python (the `crosscheck` extra): SmolLM2-135M's
Q4_1 GGUF as shipped, run by llama.cpp's own quantized kernels and its dense attention
(n_threads = the machine's cores, its default batch sizes; contexts past the GGUF's 8192
with linear RoPE scaling, as dosa's load does). dosa runs the main job's modes (their
settings from experiments/configs/run_default.yaml: the shipped indexer, top_k 1024, the
hierarchical length-budget rule) on the same GGUF dequantized to f32. For each length the
held-out text's first L tokens; each dosa mode compiled first (not timed) and then, in each
round, llama.cpp and every mode prefill once in turn (the order rotates by round), each
timed from its call to the first token's logits on the host. Beside them, the machine's
f32 matmul rate on the model's MLP shape, measured in the same process before and after.

It is a benchmark, not a test: it stays out of CI (dense at 16K-32K takes many minutes).
Writes OUT/peer_prefill.json (default runs/peer_prefill/).
"""

import argparse
import os
import pathlib
import time

import numpy as np

from experiments.common import add_out_argument, display_path, write_json

RUN_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "run_default.yaml"


def llama_cpp_prefill(path, length, scaling):
    """-> a function timing one llama.cpp prefill of `tokens` (seconds to the last logits)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=length + 16, n_threads=os.cpu_count(),
                          rope_freq_scale=1.0 / scaling, verbose=False)

    def run(tokens):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(list(map(int, tokens)))
        # Without logits_all llama-cpp-python keeps no scores: the context holds the last
        # token's logits, as a server's first sampled token reads them.
        np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax()
        return time.perf_counter() - t0

    return llm, run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--modes", default="sparse-flat,sparse-hierarchical,dense")
    parser.add_argument("--rounds", type=int, default=1)
    add_out_argument(parser, "peer_prefill")
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        parser.error("llama.cpp is not installed: pip install -e '.[crosscheck]'")

    import jax

    from experiments.model_source import PRETRAINED_CONTEXT, load_source
    from experiments.ttft.config import load_run_config
    from experiments.ttft.machine_rate import matmul_rate, model_flops
    from experiments.ttft.measure import TimedPrefill
    from experiments.ttft.plan import Prefill
    from model import ModelRunner
    from model.pretrained import fetch_pretrained
    from model.transformer import with_config

    lengths = [int(x) for x in args.lengths.split(",")]
    wanted = args.modes.split(",")
    run = load_run_config(RUN_CONFIG)
    specs = {m.name: m for m in run.modes}
    unknown = [m for m in wanted if m not in specs]
    if unknown:
        parser.error(f"--modes: {unknown} not among {sorted(specs)} (run_default.yaml)")
    source = load_source(model_name="smollm2-135m", max_length=max(lengths))
    base = source.model.config
    gguf = fetch_pretrained("smollm2-135m")
    rates = [matmul_rate(base)]
    print(f"f32 matmul rate ({rates[0]['shape']}): {rates[0]['gflops']:.1f} GFLOP/s", flush=True)
    rows = []
    for length in lengths:
        tokens = np.asarray(source.heldout_tokens[:length], np.int32)
        scaling = max(1.0, length / PRETRAINED_CONTEXT)
        timers, compile_s = {}, {}
        for name in wanted:
            config = specs[name].model_config(base)
            t0 = time.perf_counter()
            timers[name] = TimedPrefill(ModelRunner(with_config(source.model, config)), tokens,
                                        Prefill(name, config, length, length))
            compile_s[name] = time.perf_counter() - t0
        llm, peer = llama_cpp_prefill(gguf, length, scaling)
        seconds = {name: [] for name in ["llama.cpp", *wanted]}
        order = ["llama.cpp", *wanted]
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                if name == "llama.cpp":
                    seconds[name].append(peer(tokens))
                else:
                    timers[name].time_once()
                    seconds[name].append(timers[name].times[-1] / 1e3)
                print(f"{length:>6} {name:<20} {seconds[name][-1]:8.2f} s", flush=True)
        del llm
        best = {name: min(s) for name, s in seconds.items()}
        row = {"length": length, "seconds": seconds, "best_s": best,
               "compile_s": {n: round(s, 1) for n, s in compile_s.items()},
               "over_llama_cpp": {n: best[n] / best["llama.cpp"] for n in wanted},
               "model_tflop": {n: model_flops(specs[n].model_config(base), length) / 1e12
                               for n in wanted}}
        rows.append(row)
        for name in wanted:
            timers[name].out = None
        del timers
        jax.clear_caches()
    rates.append(matmul_rate(base))
    rate = max(r["gflops"] for r in rates)
    for row in rows:
        row["matmul_share"] = {n: row["model_tflop"][n] * 1e12 / row["best_s"][n] / 1e9 / rate
                               for n in wanted}
    out = pathlib.Path(args.out)
    result = {"command": "python -m experiments.benchmarks.peer_prefill "
                         f"--lengths {args.lengths} --modes {args.modes} --rounds {args.rounds} "
                         f"--out {display_path(out)}",
              "peer": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), "
                      f"{gguf.name}, n_threads {os.cpu_count()}",
              "matmul_rate": {"gflops": round(rate, 2), "shape": rates[0]["shape"],
                              "measured_gflops": [round(r["gflops"], 2) for r in rates]},
              "rows": rows}
    write_json(out / "peer_prefill.json", result)
    print(f"{'tokens':>6} {'llama.cpp s':>11} " + " ".join(f"{n[:18]:>18}" for n in wanted))
    for row in rows:
        print(f"{row['length']:>6} {row['best_s']['llama.cpp']:>11.2f} " + " ".join(
            f"{row['best_s'][n]:>8.2f} s {row['over_llama_cpp'][n]:>5.2f}x" for n in wanted))
    print(f"(dosa's time over llama.cpp's; matmul rate {rate:.1f} GFLOP/s) wrote "
          f"{out / 'peer_prefill.json'}")


if __name__ == "__main__":
    main()
