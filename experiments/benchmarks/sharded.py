"""Sharded prefill on N fake CPU devices against one device: equality, time, memory.

    python -m experiments.benchmarks.sharded [--devices 8] [--preset tiny] [--tokens 1000]
        [--indexers flat,hierarchical] [--meshes "sequence=8;sequence=4,tensor=2"]
        [--decode-steps 4] [--repeats 2] [--out DIR]

For each indexer and mesh: the same weights and tokens (real text) prefilled by
ModelRunner(model) on one device and by ModelRunner(model, mesh=...) on the mesh, then
greedy decode steps on both. Printed and written to OUT/sharded.json (default
runs/sharded/): last-position logit difference, selected indices (rows identical, rows
different only by near-ties of the exact index scores), decode logits and tokens, median
prefill seconds (1 device vs the mesh: this CPU's fake devices share its cores, so no speed
claim), bytes per device of the KV cache, of the replicated indexer keys + block summaries
and of the parameters, and the collectives XLA compiled into one chunk step (result bytes
per kind, for `python -m experiments.costmodel sharding --measured OUT/sharded.json`).
--devices sets XLA's host device count, so it must come before JAX starts: run this as a
script, not from a process that already imported jax.
"""

import os
import sys


def _force_host_devices(argv):
    """XLA_FLAGS for --devices fake CPU devices (only effective before jax is imported)."""
    n = "8"
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            n = argv[i + 1]
        elif a.startswith("--devices="):
            n = a.split("=", 1)[1]
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__" and "jax" not in sys.modules:
    _force_host_devices(sys.argv[1:])

import argparse  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.common import (  # noqa: E402
    add_out_argument,
    enable_compile_cache,
    machine_description,
    recorded_command,
    stdlib_text,
    write_json,
)
from experiments.costmodel.sharding import hlo_collectives  # noqa: E402
from model import ModelRunner, Transformer, get_config, tokenizer  # noqa: E402
from model.buckets import chunk_plan, length_bucket  # noqa: E402
from model.cache import cache_capacity, cache_specs, field  # noqa: E402
from model.sharding import (  # noqa: E402
    axis_size,
    make_mesh,
    param_specs,
    per_device_bytes,
)

DEFAULT_MESHES = "sequence=8;sequence=4,tensor=2;sequence=2,tensor=2,data=2;tensor=2,data=4"


def index_scores_np(q, w, k, rows, tokens):
    """Exact index scores f64 of `tokens` for query `rows` (q [N, H, d], w [N, H], k [N, d])."""
    dots = np.einsum("hd,sd->hs", q[rows].astype(np.float64), k[tokens].astype(np.float64))
    return np.maximum(dots, 0).T @ w[rows].astype(np.float64)


def compare_indices(got, want, indexer_inputs, *, rtol=1e-4):
    """Selected sets of the mesh run (got) vs one device (want), i32[n_layers, N, K], per
    (layer, query) row: identical; a near-tie (the two sets' exact scores on the reference's
    indexer inputs, sorted, differ by at most rtol x the row's largest |score|); or other.
    A flipped near-tie changes what that query attends to, hence its later layers' inputs
    and, through its K/V, other queries' (cascade): `after_earlier_difference` counts the
    differing rows whose query already differed in an earlier layer. Also the differing
    rows per layer and the largest relative score gap among them."""
    same = ties = cascade = 0
    total = got.shape[0] * got.shape[1]
    per_layer, worst = [], 0.0
    differed = np.zeros(got.shape[1], bool)
    for layer in range(got.shape[0]):
        q, w, k = (np.asarray(a[layer]) for a in indexer_inputs)
        now = np.zeros(got.shape[1], bool)
        for t in range(got.shape[1]):
            a, b = got[layer, t], want[layer, t]
            a, b = a[a >= 0], b[b >= 0]
            if set(a.tolist()) == set(b.tolist()):
                same += 1
                continue
            now[t] = True
            cascade += bool(differed[t])
            if len(a) != len(b):
                continue
            sa, sb = (np.sort(index_scores_np(q, w, k, t, x)) for x in (a, b))
            gap = float(np.max(np.abs(sa - sb)) / max(np.max(np.abs(sb)), 1e-30))
            worst = max(worst, gap)
            ties += gap <= rtol
        differed |= now
        per_layer.append(int(now.sum()))
    return {"rows": total, "identical": same, "near_ties": ties,
            "other": total - same - ties, "after_earlier_difference": cascade,
            "near_tie_share": ties / total, "mismatch_share": (total - same) / total,
            "differing_rows_per_layer": per_layer, "largest_relative_gap": worst,
            "tie_rtol": rtol}


def _median_seconds(fn, repeats):
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _greedy_decode(runner, logits, cache, position, steps):
    out_logits, tokens = [], []
    for i in range(steps):
        token = int(np.argmax(np.asarray(logits)))
        tokens.append(token)
        logits, cache = runner.decode(token, cache, position + i)
        out_logits.append(np.asarray(logits))
    return out_logits, tokens


def cache_bytes(cache):
    """Bytes per device: the KV part of the cache (split) and the index part (indexer keys +
    summaries, replicated; shared layers hold none), by their model.cache fields' parts."""
    parts = {part: [c.fields[n] for c in cache for n in c.names if field(n).part == part]
             for part in ("kv", "index")}
    kv, rep = per_device_bytes(parts["kv"]), per_device_bytes(parts["index"])
    return {"kv_per_device": max(kv.values()), "kv_total": sum(a.nbytes for a in parts["kv"]),
            "replicated_per_device": max(rep.values()),
            "replicated_total": sum(a.nbytes for a in parts["index"])}


def shardings_follow_rules(state, cache):
    """Every parameter and cache array placed as model.sharding's rules say."""
    def same(x, spec):
        return x.sharding.is_equivalent_to(jax.sharding.NamedSharding(x.sharding.mesh, spec),
                                           x.ndim)
    ok = jax.tree.leaves(jax.tree.map(same, state, param_specs(state)))
    ok += jax.tree.leaves(jax.tree.map(same, cache, cache_specs(cache),
                                       is_leaf=lambda x: isinstance(x, jax.Array)))
    return bool(all(ok))


def step_collectives(runner, n_tokens, capacity, chunk):
    """{kind: bytes} of the collectives compiled into the first chunk step of a prefill."""
    cache = runner.new_cache(capacity)
    c = chunk_plan(n_tokens, start=0, capacity=cache_capacity(cache), chunk=chunk)[0]
    text = runner.lower_step(np.zeros(c.padded, np.int32), cache, c.position, c.kv_len,
                             c.length).compile().as_text()
    return c.padded, hlo_collectives(text)


def compare(model, tokens, mesh_text, *, decode_steps=4, repeats=2, reference=None,
            timed=True, collectives=True):
    """Single device vs `mesh_text` for one model -> (dict of figures (see module doc),
    reference). reference: a previous call's single-device results for the same model and
    tokens. timed / collectives: measure prefill seconds / compile the collectives (tests
    skip both)."""
    config = model.config
    n = len(tokens)
    capacity = n + decode_steps
    capture = ("indices", "indexer")
    if reference is None:
        single = ModelRunner(model)
        logits, cache, got = single.prefill(tokens, capacity=capacity, capture=capture)
        dec_logits, dec_tokens = _greedy_decode(single, logits, cache, n, decode_steps)
        reference = {"runner": single, "logits": np.asarray(logits), "captured": got,
                     "decode_logits": dec_logits, "decode_tokens": dec_tokens,
                     "seconds": _median_seconds(lambda: single.prefill(tokens)[0], repeats)
                     if timed else None}
    mesh = make_mesh(mesh_text)
    runner = ModelRunner(model, mesh=mesh)
    logits, cache, got = runner.prefill(tokens, capacity=capacity, capture=capture)
    logits = np.asarray(logits)
    follows = shardings_follow_rules(runner.state, cache)
    memory = cache_bytes(cache)
    memory["params_per_device"] = max(per_device_bytes(runner.state).values())
    dec_logits, dec_tokens = _greedy_decode(runner, logits, cache, n, decode_steps)
    ref_logits = reference["logits"]
    rows, coll = (step_collectives(runner, n, capacity, config.prefill_chunk) if collectives
                  else (None, None))
    result = {
        "mesh": mesh_text, **{a: axis_size(mesh, a) for a in mesh.axis_names},
        "last_logits_max_abs_diff": float(np.max(np.abs(logits - ref_logits))),
        "last_logits_scale": float(np.max(np.abs(ref_logits))),
        "same_next_token": int(np.argmax(logits)) == int(np.argmax(ref_logits)),
        "indices": compare_indices(np.asarray(got["indices"]),
                                   np.asarray(reference["captured"]["indices"]),
                                   reference["captured"]["indexer"]),
        "decode_logits_max_abs_diff": float(max(np.max(np.abs(a - b)) for a, b in zip(
            dec_logits, reference["decode_logits"]))) if decode_steps else 0.0,
        "decode_tokens_equal": dec_tokens == reference["decode_tokens"],
        "shardings_follow_rules": follows,
        "memory": memory,
        "seconds_one_device": reference["seconds"],
        "seconds_mesh": (_median_seconds(lambda: runner.prefill(tokens)[0], repeats)
                         if timed else None),
        "collectives": {"rows": rows, "bytes": coll},
    }
    return result, reference


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (XLA_FLAGS)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=1000, help="prompt length (real text)")
    p.add_argument("--indexers", default="flat,hierarchical")
    p.add_argument("--meshes", default=DEFAULT_MESHES, help="';'-separated --mesh strings")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    add_out_argument(p, "sharded")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.decode_steps < 0 or args.repeats < 1:
        p.error("--tokens and --repeats must be >= 1, --decode-steps >= 0")
    if len(jax.devices()) != args.devices:
        p.error(f"--devices {args.devices}: JAX has {len(jax.devices())} devices (run this "
                "module as a script so that XLA_FLAGS is set before jax starts)")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    enable_compile_cache()
    text_tokens = np.asarray(tokenizer.encode(stdlib_text(4 * args.tokens)), np.int32)
    tokens = text_tokens[:args.tokens]
    runs, collectives = [], []
    for kind in [k.strip() for k in args.indexers.split(",") if k.strip()]:
        overrides = {"indexer": kind,
                     "max_seq_len": max(get_config(args.preset).max_seq_len,
                                        length_bucket(args.tokens + args.decode_steps))}
        model = Transformer(get_config(args.preset, **overrides), rngs=nnx.Rngs(0))
        reference = None
        for mesh_text in [m.strip() for m in args.meshes.split(";") if m.strip()]:
            r, reference = compare(model, tokens, mesh_text, decode_steps=args.decode_steps,
                                   repeats=args.repeats, reference=reference)
            r["indexer"] = kind
            runs.append(r)
            collectives.append({"preset": args.preset, "overrides": overrides,
                                "mesh": mesh_text, "sequence": r["sequence"],
                                "tensor": r["tensor"], **r["collectives"]})
            ix, m = r["indices"], r["memory"]
            print(f"{kind:12s} {mesh_text:28s} logits diff {r['last_logits_max_abs_diff']:.2e} "
                  f"(scale {r['last_logits_scale']:.1f}), indices identical "
                  f"{ix['identical']}/{ix['rows']} near-ties {ix['near_ties']} other "
                  f"{ix['other']} (per layer {ix['differing_rows_per_layer']}), decode diff "
                  f"{r['decode_logits_max_abs_diff']:.2e} tokens "
                  f"equal {r['decode_tokens_equal']}, rules {r['shardings_follow_rules']}, "
                  f"{r['seconds_one_device']:.3f} s (1 device) vs {r['seconds_mesh']:.3f} s "
                  f"(mesh), KV/device {m['kv_per_device']} of {m['kv_total']} B, "
                  f"replicated/device {m['replicated_per_device']} B, params/device "
                  f"{m['params_per_device']} B", flush=True)
    command = recorded_command("experiments.benchmarks.sharded", argv)
    out = write_json(pathlib.Path(args.out) / "sharded.json", {
        "command": command, "machine": machine_description(), "jax": jax.__version__,
        "devices": args.devices, "preset": args.preset, "tokens": args.tokens,
        "runs": runs, "collectives": collectives})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
