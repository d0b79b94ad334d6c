"""Prefill time of the `small` model vs context length, side by side in one run.

    python -m experiments.bench_prefill [--lengths 4096,8192,16384] [--attention sparse]

Random weights (time does not depend on their values); real text as input. Reports the
median prefill time per length (compile excluded) and the ratio to the first length.
"""

import argparse

import numpy as np
from flax import nnx

from experiments.common import (enable_compile_cache, machine_description, stdlib_text,
                                time_call, write_json)
from model import ModelRunner, Transformer, get_config, tokenizer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--preset", default="small")
    p.add_argument("--attention", default="sparse", choices=["dense", "sparse"])
    p.add_argument("--indexer", default="flat")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    enable_compile_cache()
    lengths = [int(x) for x in args.lengths.split(",")]
    config = get_config(args.preset, attention=args.attention, indexer=args.indexer,
                        max_seq_len=max(max(lengths), get_config(args.preset).max_seq_len))
    runner = ModelRunner(Transformer(config, rngs=nnx.Rngs(0)))
    text = stdlib_text(max(lengths))
    rows = []
    print(f"{args.preset} prefill, attention={args.attention}, indexer={args.indexer}, "
          f"chunk={config.prefill_chunk}, top_k={config.top_k} on {machine_description()}")
    print(f"{'tokens':>8} {'seconds':>9} {'tok/s':>8} {'x time':>7} {'x length':>8}")
    for n in lengths:
        tokens = np.asarray(tokenizer.encode(text, bos=True)[:n], np.int32)
        seconds = time_call(lambda: runner.prefill(tokens)[0], repeats=args.repeats)
        rows.append({"tokens": n, "seconds": seconds})
        base = rows[0]
        print(f"{n:>8} {seconds:>9.3f} {n / seconds:>8.0f} {seconds / base['seconds']:>7.2f} "
              f"{n / base['tokens']:>8.1f}")
    path = write_json(f"bench_prefill_{args.preset}_{args.attention}_{args.indexer}.json",
                      {"config": config.to_dict(), "machine": machine_description(), "rows": rows})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
