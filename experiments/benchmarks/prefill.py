"""Prefill time of the `small` model vs context length, indexer variants side by side.

    python -m experiments.benchmarks.prefill [--lengths 4096,8192,16384] [--attention sparse]
        [--indexers flat,hierarchical,hierarchical:0]

Random weights (time does not depend on their values; every variant gets the same ones);
real text as input. A variant is `flat`, `hierarchical`, or `hierarchical:I[:J...]`: the
hierarchical indexer with layers I, J... kept flat (ModelConfig.flat_index_layers). For each
length the variants are timed one after the other (median prefill time, compile excluded);
printed: seconds, the ratio to the first length, and the first variant's time over each
other's (the speedup of the others, measured in the same run).
"""

import argparse
import pathlib

import numpy as np
from flax import nnx

from experiments.common import (
    add_out_argument,
    enable_compile_cache,
    machine_description,
    stdlib_text,
    time_call,
    write_json,
)
from indexer.selection import selection_names
from model import ModelRunner, Transformer, get_config, tokenizer


def parse_variant(spec, n_layers):
    """A selection kind (indexer.selection), or KIND:I[:J...] with layers I, J... kept flat
    (e.g. 'hierarchical:0:2') -> dict of ModelConfig overrides."""
    name, *layers = spec.strip().split(":")
    if name not in selection_names() or (layers and name == "flat"):
        raise ValueError(f"indexer variant must be one of {selection_names()}, or KIND:I[:J...] "
                         f"(layers kept flat), got {spec!r}")
    try:
        flat_layers = tuple(int(x) for x in layers)
    except ValueError:
        raise ValueError(f"indexer variant {spec!r}: layers must be ints in "
                         f"[0, {n_layers - 1}]") from None
    return dict(indexer=name, flat_index_layers=flat_layers)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--preset", default="small")
    p.add_argument("--attention", default="sparse", choices=["dense", "sparse"])
    p.add_argument("--indexers", default="flat,hierarchical",
                   help="comma-separated variants: flat, hierarchical, hierarchical:I[:J...]")
    p.add_argument("--repeats", type=int, default=2)
    add_out_argument(p, "bench_prefill")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    base = get_config(args.preset, attention=args.attention,
                      max_seq_len=max(max(lengths), get_config(args.preset).max_seq_len))
    names = [v.strip() for v in args.indexers.split(",") if v.strip()]
    try:
        configs = [base.replace(**parse_variant(v, base.n_layers)) for v in names]
    except ValueError as e:
        p.error(str(e))
    enable_compile_cache()
    runners = [ModelRunner(Transformer(c, rngs=nnx.Rngs(0))) for c in configs]
    text = stdlib_text(max(lengths))
    print(f"{args.preset} prefill, attention={args.attention}, chunk={base.prefill_chunk}, "
          f"top_k={base.top_k} on {machine_description()}")
    head = "".join(f" {v + ' s':>18} {'x time':>7}" for v in names)
    ratios = "".join(f" {names[0] + '/' + v:>26}" for v in names[1:])
    print(f"{'tokens':>8}{head}{ratios}")
    rows = []
    for n in lengths:
        tokens = np.asarray(tokenizer.encode(text, bos=True)[:n], np.int32)
        seconds = {v: time_call(lambda r=r, tokens=tokens: r.prefill(tokens)[0],
                                repeats=args.repeats)
                   for v, r in zip(names, runners)}
        rows.append({"tokens": n, "seconds": seconds})
        first = rows[0]["seconds"]
        cells = "".join(f" {seconds[v]:>18.3f} {seconds[v] / first[v]:>7.2f}" for v in names)
        ratio_cells = "".join(f" {seconds[names[0]] / seconds[v]:>25.2f}x" for v in names[1:])
        print(f"{n:>8}{cells}{ratio_cells}", flush=True)
    path = write_json(pathlib.Path(args.out) / f"bench_prefill_{args.preset}_{args.attention}.json",
                      {"variants": {v: c.to_dict() for v, c in zip(names, configs)},
                       "machine": machine_description(), "rows": rows})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
