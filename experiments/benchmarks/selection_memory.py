"""Memory and time of flat selection with and without the [queries x context] score matrix:
the flat kind (lax.top_k over each query chunk's full score rows) against the streaming
kind (indexer.streaming: key tiles merged into a running top_k), side by side, and the flat
kind as it ran before the xla path's budgeted steps ("flat_512": 512-query scoring steps and
whole-chunk attention, set through indexer.scoring.XLA_QUERY_CHUNK / XLA_SCORE_BYTES,
pallas_kernels.api.XLA_ATTENTION_* and model.attention.DENSE_ATTENTION_* while it compiles).

    python -m experiments.benchmarks.selection_memory [--context 65536] [--queries 1024]
        [--preset small] [--repeats 3] [--out DIR]

Two measurements, both on the last `--queries` positions of a `--context`-token prefill:
- compiled peak memory: XLA's memory_analysis() (temporaries + arguments + outputs) of
  (a) the selection call alone, (b) one prefill chunk step of the `--preset` model (the
  runner's jitted step, every layer flat or streaming), compiled without running;
- time and equality: the selection call on seeded random inputs of the preset's indexer
  shape, the two kinds timed interleaved (one call of each per round), indices compared
  row by row (equal, or a tie of equal scores).
Writes OUT/selection_memory.json (default runs/selection_memory/).
"""

import argparse
import contextlib
import functools
import pathlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import indexer.scoring
import model.attention
import pallas_kernels.api
from experiments.benchmarks.support import equal_up_to_ties, median_interleaved, random_inputs
from experiments.common import add_out_argument, display_path, machine_description, write_json
from experiments.gpu_targets import peak_bytes
from indexer import flat_topk
from indexer.streaming import streaming_topk
from model import ModelRunner, Transformer, get_config, init_cache
from model.buckets import length_bucket

KINDS = ("flat_512", "flat", "streaming")
SELECT = {"flat_512": flat_topk, "flat": flat_topk, "streaming": streaming_topk}
SELECTION_KIND = {"flat_512": "flat", "flat": "flat", "streaming": "streaming"}


def former_defaults(kind):
    """The constants of the xla path before its budgeted steps, for kind flat_512."""
    if kind != "flat_512":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(indexer.scoring, "XLA_QUERY_CHUNK", 512))
    stack.enter_context(mock.patch.object(indexer.scoring, "XLA_SCORE_BYTES", 1 << 60))
    stack.enter_context(mock.patch.object(pallas_kernels.api, "XLA_ATTENTION_ROWS", 1 << 30))
    stack.enter_context(mock.patch.object(pallas_kernels.api, "XLA_ATTENTION_BYTES", 1 << 60))
    stack.enter_context(mock.patch.object(model.attention, "DENSE_ATTENTION_ROWS", 1 << 30))
    stack.enter_context(mock.patch.object(model.attention, "DENSE_ATTENTION_BYTES", 1 << 60))
    return stack


def selection_program(kind, top_k, q_offset):
    return jax.jit(functools.partial(SELECT[kind], top_k=top_k, q_offset=q_offset))


def step_peak(config, kind, context, queries):
    """Peak bytes of the prefill chunk step whose `queries` tokens end at `context`."""
    runner = ModelRunner(Transformer(config.replace(indexer=kind), rngs=nnx.Rngs(0)))
    cache = jax.eval_shape(lambda: init_cache(runner.config, length_bucket(context)))
    lowered = runner.lower_step(jax.ShapeDtypeStruct((queries,), jnp.int32), cache,
                                context - queries, length_bucket(context), queries)
    compiled = lowered.compile()
    return peak_bytes(compiled), int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--preset", default="small")
    p.add_argument("--repeats", type=int, default=3)
    add_out_argument(p, "selection_memory")
    args = p.parse_args(argv)
    if not 1 <= args.queries <= args.context:
        p.error(f"--queries must be in [1, --context={args.context}], got {args.queries}")
    config = get_config(args.preset, max_seq_len=max(args.context, 1024),
                        prefill_chunk=args.queries)
    H, d, top_k = config.index_heads, config.index_dim, config.top_k
    offset = args.context - args.queries
    q, w, k, _ = random_inputs(0, args.context, args.queries, H, d)
    q, w, k = jnp.asarray(q), jnp.asarray(w), jnp.asarray(k)
    out = dict(context=args.context, queries=args.queries, preset=args.preset,
               index_heads=H, index_dim=d, top_k=top_k, hardware=machine_description(),
               command="python -m experiments.benchmarks.selection_memory "
                       f"--context {args.context} --queries {args.queries} "
                       f"--preset {args.preset} --repeats {args.repeats}", kinds={})
    programs = {}
    for kind in KINDS:
        with former_defaults(kind):
            programs[kind] = selection_program(kind, top_k, offset).lower(q, w, k).compile()
            step, step_temp = step_peak(config, SELECTION_KIND[kind], args.context,
                                        args.queries)
        jax.clear_caches()  # jit caches traces: no kind may reuse another's constants
        out["kinds"][kind] = dict(selection_peak_bytes=peak_bytes(programs[kind]),
                                  step_peak_bytes=step, step_temp_bytes=step_temp)
    seconds = median_interleaved({kind: functools.partial(programs[kind], q, w, k)
                                  for kind in KINDS}, args.repeats)
    got = {kind: np.asarray(programs[kind](q, w, k)) for kind in KINDS}
    for kind in KINDS:
        out["kinds"][kind]["selection_seconds"] = round(seconds[kind], 4)
    former = out["kinds"]["flat_512"]
    out["identical_rows"] = {kind: int(np.sum(np.all(got[kind] == got["flat_512"], axis=1)))
                             for kind in KINDS[1:]}
    out["equal_up_to_ties"] = {kind: bool(equal_up_to_ties(q, w, k, got[kind],
                                                           got["flat_512"]))
                               for kind in KINDS[1:]}
    # vs flat_512: memory as former / kind (x smaller), time as kind / former
    out["vs_flat_512"] = {kind: dict(
        selection_memory=round(former["selection_peak_bytes"]
                               / out["kinds"][kind]["selection_peak_bytes"], 2),
        step_memory=round(former["step_peak_bytes"] / out["kinds"][kind]["step_peak_bytes"], 2),
        time=round(out["kinds"][kind]["selection_seconds"] / former["selection_seconds"], 3))
        for kind in KINDS[1:]}
    for kind in KINDS:
        r = out["kinds"][kind]
        print(f"{kind:>9}: selection peak {r['selection_peak_bytes'] / 2**20:8.1f} MiB, "
              f"chunk step peak {r['step_peak_bytes'] / 2**20:8.1f} MiB "
              f"(temporaries {r['step_temp_bytes'] / 2**20:.1f}), "
              f"selection {r['selection_seconds']:.3f} s")
    for kind, r in out["vs_flat_512"].items():
        print(f"{kind} vs flat_512: memory {r['selection_memory']}x less (selection), "
              f"{r['step_memory']}x less (chunk step); time {r['time']}x; rows identical "
              f"{out['identical_rows'][kind]}/{args.queries}, equal up to ties "
              f"{out['equal_up_to_ties'][kind]}")
    path = pathlib.Path(args.out) / "selection_memory.json"
    write_json(path, out)
    print(f"wrote {display_path(path)}")
    return out


if __name__ == "__main__":
    main()
