"""The recall-speed frontier of the hierarchical indexer on a trained model's own inputs:
every coarse scorer and budget rule side by side in one run, against flat.

    python -m experiments.benchmarks.frontier [--lengths 16384,32768] [--out DIR]
    python -m experiments.benchmarks.frontier --model smollm2-135m --lengths 16384,32768

For each length L the model reads L held-out tokens (experiments.model_source) and its own
prefill (sparse, flat selection: as deployed) captures every layer's indexer queries and
weights for the last --queries positions and the whole key cache. Per layer, timed
interleaved after a compile-only warm-up (medians of --repeats): flat top-k, then for each
coarse scorer (`mean`; `learned` when the model has trained screens; model.coarse_screen_file)
and each budget rule:

- fixed: candidate_tokens in --budgets (the static budget);
- mass: coarse_mass in --masses, at most --mass-max tokens (the adaptive rule, at the
  screen's fitted temperature; each chunk of queries runs at the smallest of the
  --mass-buckets that holds its largest need, so speed follows the need);
- ratio: coarse_keep_ratio in --ratios (the reference's COARSE_THRESHOLD);
- --extra "NAME:FIELD=VALUE,...;...": any other HierarchicalConfig over the base (e.g.
  tables no larger than the budget, `tile_candidate_tokens=8192`, or exact mode,
  `exact=true`), one row per scorer, rule NAME (another `block_size`: the mean scorer's
  row only, on block summaries of that size; the learned screens fit the base's blocks).

Exact flat paths: flat top-k (one ranking per row of scores, lax.top_k), flat ranked by
threshold (--flat-threshold, on by default: FlatConfig.fast_ranking, no sort; near-ties either
way, so its recall may sit a hair under 1) and the streaming selection (indexer.streaming: key
tiles of --streaming-tiles, a running top-k, no score matrix; its rows say whether it matched
flat index for index). --reuse PATTERN,...: selection reuse across layers
(ModelConfig.indexer_types; freqN keeps layers 0, N, 2N, ... or an F/S string, F runs its
indexer, S reuses the nearest earlier F layer's selection), one row per pattern and exact path
or fixed budget: a shared layer costs nothing and its recall is its source layer's selection
against the shared layer's *own* flat top-k. Recall is against flat top-k on the same inputs,
averaged over layers; speedup is the fastest exact flat path's time over the row's, both summed
over layers. ceiling: the best recall any choice of that many blocks reaches
(indexer.block_recall_ceiling), per fixed budget; mass and ratio rows give the candidate blocks
they kept and ran at; "scored" is the share of the visible blocks scored exactly per query
(exact mode's rescoring included: where exact mode prunes).
--offset N reads each length's window from held-out token N on (another window of the same
text). Writes OUT/frontier.json, OUT/frontier.md, OUT/frontier.png (--out, default runs/frontier/).
"""

import argparse
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import indexer
from experiments.benchmarks.support import jit_block_summaries, median_interleaved
from experiments.common import (
    add_out_argument,
    display_path,
    enable_compile_cache,
    machine_description,
    parse_hierarchical,
    recorded_command,
    write_json,
)
from experiments.data import eval_sequence, model_indexer_inputs
from experiments.model_source import load_source
from indexer.config import STREAMING_KEY_TILE
from indexer.streaming import streaming_topk
from model.coarse_screen_file import has_coarse_screen
from model.config import reuse_types


def variants(base, args, methods):
    """{name: (method, rule, knob value, HierarchicalConfig)} of every run."""
    out = {}
    for method in methods:
        cfg = base.replace(coarse=method, coarse_mass=None, exact=False)
        for tokens in args.budgets:
            out[f"{method}/fixed/{tokens}"] = (method, "fixed", tokens,
                                               cfg.replace(candidate_tokens=tokens))
        for mass in args.masses:
            out[f"{method}/mass/{mass}"] = (method, "mass", mass, cfg.replace(
                candidate_tokens=args.mass_max, coarse_mass=mass,
                mass_buckets=tuple(args.mass_buckets)))
        for ratio in args.ratios:
            out[f"{method}/ratio/{ratio}"] = (method, "ratio", ratio, cfg.replace(
                candidate_tokens=None, coarse_keep_ratio=ratio))
        for name, fields in args.extra:
            extra = parse_hierarchical(fields, cfg)
            if method == "learned" and extra.block_size != base.block_size:
                continue  # the screens were fitted to the base's blocks: mean rows only
            out[f"{method}/{name}"] = (method, name, extra.candidate_tokens, extra)
    return out


def parse_extra(text):
    """'NAME:FIELD=VALUE,...;...' -> [(NAME, 'FIELD=VALUE,...')]."""
    out = []
    for item in (text or "").split(";"):
        if item.strip():
            name, sep, fields = item.partition(":")
            if not sep or not name.strip() or "/" in name:
                raise argparse.ArgumentTypeError(
                    f"--extra items are NAME:FIELD=VALUE,... (NAME without '/'), got {item!r}")
            out.append((name.strip(), fields))
    return out


def bench_layer(q, w, k, top_k, q_offset, runs, screen, args):
    """One layer -> ({"flat_s", run name: {time_s, recall, kept_blocks, run_blocks}},
    {run name: its selection} of the runs reuse rows are built from, when --reuse)."""
    summaries = {size: jax.block_until_ready(jit_block_summaries(k, block_size=size))
                 for size in {args.block_size, *(cfg.block_size for *_, cfg in runs.values())}}
    fns = {"flat": lambda: indexer.flat_topk(q, w, k, top_k, q_offset=q_offset,
                                             query_chunk=args.flat_chunk)}
    if args.flat_threshold:
        fns["flat/threshold"] = lambda: indexer.flat_topk(
            q, w, k, top_k, q_offset=q_offset, query_chunk=args.flat_chunk, fast_ranking=True)
    for tile in args.streaming_tiles:
        fns[f"streaming/{tile}"] = (lambda t: lambda: streaming_topk(
            q, w, k, top_k, q_offset=q_offset, key_tile=t, query_chunk=args.flat_chunk))(tile)
    for name, (_, _, _, cfg) in runs.items():
        fns[name] = (lambda c: lambda: indexer.hierarchical_topk(
            q, w, k, top_k, c, q_offset=q_offset, summaries=summaries[c.block_size],
            screen=screen))(cfg)
    outs = {name: np.asarray(jax.block_until_ready(fn())) for name, fn in fns.items()}
    times = median_interleaved(fns, args.repeats)
    flat = outs["flat"]
    res = {"flat_s": times["flat"]}
    if args.flat_threshold:
        res["flat/threshold"] = dict(time_s=times["flat/threshold"],
                                     recall=indexer.recall(outs["flat/threshold"], flat))
    for tile in args.streaming_tiles:
        name = f"streaming/{tile}"
        res[name] = dict(time_s=times[name], equal=bool(np.array_equal(outs[name], flat)),
                         recall=indexer.recall(outs[name], flat))
    for name, (_, _, _, cfg) in runs.items():
        _, stats = indexer.hierarchical_topk_with_stats(q, w, k, top_k, cfg, q_offset=q_offset,
                                                       summaries=summaries[cfg.block_size],
                                                       screen=screen)
        res[name] = dict(time_s=times[name], recall=indexer.recall(outs[name], flat),
                         kept_blocks=float(stats["kept_blocks"]),
                         run_blocks=float(stats["run_blocks"]),
                         scored=float(stats["scored_fraction"]))
        if cfg.candidate_tokens and cfg.coarse_mass is None and not cfg.exact:
            # the best choice of as many blocks as it really keeps (the forced sink, local
            # and bound blocks may raise a small budget)
            res[name]["ceiling"] = indexer.block_recall_ceiling(
                flat, int(stats["candidate_blocks"]), cfg.block_size)
    kept = {name: outs[name] for name in reuse_bases(runs)} if args.reuse else {}
    return res, kept


def reuse_bases(runs):
    """The runs that reuse rows are built on: flat, and every fixed budget."""
    return ["flat"] + [name for name, (_, rule, _, _) in runs.items() if rule == "fixed"]


def reuse_rows(L, per_layer, selections, runs, patterns, config, fastest_s):
    """One row per (reuse pattern, base run): time summed over the layers that run their own
    selection, recall of each layer's selection (its source layer's when shared) against the
    layer's own flat top-k, averaged over layers."""
    rows = []
    for pattern in patterns:
        reuse = config.replace(indexer_types=reuse_types(pattern))
        sources = [reuse.selection_source(i) for i in range(config.n_layers)]
        full = [i for i in range(config.n_layers) if sources[i] == i]
        for name in reuse_bases(runs):
            times = [per_layer[i]["flat_s"] if name == "flat" else per_layer[i][name]["time_s"]
                     for i in full]
            recalls = [indexer.recall(selections[sources[i]][name], selections[i]["flat"])
                       for i in range(config.n_layers)]
            method, rule, knob = ("flat", "exact", None) if name == "flat" else runs[name][:3]
            rows.append(dict(name=f"{name}@{pattern}", method=method, rule=rule, knob=knob,
                             reuse=pattern, indexers=len(full), length=L,
                             hierarchical_s=sum(times), speedup=fastest_s / sum(times),
                             recall=float(np.mean(recalls)), recall_per_layer=recalls,
                             kept_blocks=None, run_blocks=None, scored=None, ceiling=None))
    return rows


def summarize(L, per_layer, runs, tiles):
    flat_s = sum(r["flat_s"] for r in per_layer)
    # the exact flat paths other than flat's own lax.top_k: (name, method, rule, knob)
    paths = ([("flat/threshold", "flat", "threshold", None)] if "flat/threshold" in per_layer[0]
             else []) + [(f"streaming/{t}", "streaming", "key tile", t) for t in tiles]
    exact = {"flat": flat_s} | {name: sum(r[name]["time_s"] for r in per_layer)
                                for name, *_ in paths}
    fastest = min(exact, key=exact.get)
    rows = [dict(name=name, method=method, rule=rule, knob=knob, length=L,
                 hierarchical_s=exact[name], speedup=exact[fastest] / exact[name],
                 recall=float(np.mean([r[name]["recall"] for r in per_layer])),
                 kept_blocks=None, run_blocks=None, scored=1.0, ceiling=None)
            | ({"equal": all(r[name]["equal"] for r in per_layer)} if method == "streaming"
               else {})
            for name, method, rule, knob in paths]
    for name, (method, rule, knob, cfg) in runs.items():
        hier_s = sum(r[name]["time_s"] for r in per_layer)
        rows.append(dict(
            name=name, method=method, rule=rule, knob=knob, length=L, hierarchical_s=hier_s,
            config=cfg.to_dict(),
            speedup=exact[fastest] / hier_s,
            recall=float(np.mean([r[name]["recall"] for r in per_layer])),
            recall_per_layer=[r[name]["recall"] for r in per_layer],
            kept_blocks=float(np.mean([r[name]["kept_blocks"] for r in per_layer])),
            run_blocks=float(np.mean([r[name]["run_blocks"] for r in per_layer])),
            scored=float(np.mean([r[name]["scored"] for r in per_layer])),
            ceiling=(float(np.mean([r[name]["ceiling"] for r in per_layer]))
                     if "ceiling" in per_layer[0][name] else None)))
    return dict(length=L, flat_s=flat_s, exact_s=exact, fastest_exact=fastest, rows=rows)


def markdown(result):
    fastest = ", ".join(f"L={x['length']}: {x['fastest_exact']}" for x in result["lengths"])
    digest = result.get("indexer_sha256")
    model = result["model"] + (f" (indexer sha256 {digest[:8]})" if digest else "")
    lines = [f"Recall-speed frontier: {model}, last {result['queries']} queries, "
             f"top_k {result['top_k']}, blocks of {result['block_size']}; speedup = the "
             f"fastest exact flat path's time ({fastest}) / the row's, summed over "
             f"{result['layers']} layers, recall vs flat (mean over layers); streaming rows: "
             f"exact flat over key tiles (= flat index for index: "
             f"{all(r.get('equal', True) for x in result['lengths'] for r in x['rows'])}). "
             f"{result['machine']}.", "",
             "| L | scorer | rule | knob | reuse | speedup | recall | ceiling | "
             "blocks kept / run | scored |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for length in result["lengths"]:
        for r in length["rows"]:
            ceiling = f"{r['ceiling']:.4f}" if r["ceiling"] is not None else ""
            blocks = ("" if r["kept_blocks"] is None else
                      f"{r['kept_blocks']:.1f} / {r['run_blocks']:.1f}")
            scored = "" if r["scored"] is None else f"{r['scored']:.3f}"
            lines.append(f"| {r['length']} | {r['method']} | {r['rule']} | "
                         f"{'' if r['knob'] is None else r['knob']} | {r.get('reuse') or ''} | "
                         f"{r['speedup']:.2f}x | {r['recall']:.4f} | {ceiling} | {blocks} | "
                         f"{scored} |")
    return "\n".join(lines)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["lengths"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.4), squeeze=False)
    styles = {"mean": "tab:blue", "learned": "tab:red"}
    marks = {"fixed": "o-", "mass": "s--", "ratio": "^:"}
    for ax, length in zip(axes[0], lengths):
        lines = [r for r in length["rows"] if not r.get("reuse")]
        for method in sorted({r["method"] for r in lines} - {"streaming", "flat"}):
            for rule in dict.fromkeys(r["rule"] for r in lines):
                pts = sorted((r["recall"], r["speedup"]) for r in lines
                              if r["method"] == method and r["rule"] == rule)
                if pts:
                    ax.plot(*zip(*pts), marks.get(rule, "D"), color=styles.get(method, "k"),
                            label=f"{method}, {rule}")
                if pts and rule not in marks:  # an --extra variant: name the point
                    for x, y in pts:
                        ax.annotate(rule, (x, y), textcoords="offset points", xytext=(4, 4),
                                    fontsize=7)
        for r in length["rows"]:
            if r["method"] in ("streaming", "flat") or r.get("reuse"):
                label = (f"{r['method']} {r['knob'] or r['rule']}" if not r.get("reuse") else
                         f"{r['method']} {r['knob'] or ''} @{r['reuse'][:8]}")
                ax.plot(r["recall"], r["speedup"], "kx" if not r.get("reuse") else "gD")
                ax.annotate(label, (r["recall"], r["speedup"]),
                            textcoords="offset points", xytext=(-60, 4), fontsize=7)
        fixed = [r for r in length["rows"] if r["rule"] == "fixed" and r["method"] == "mean"]
        if fixed:  # the ceiling of each fixed budget, at that budget's measured speed
            ax.plot([r["ceiling"] for r in fixed], [r["speedup"] for r in fixed], "k*",
                    label="ceiling (best blocks, mean-screen speed)")
        ax.set_xlabel("recall vs flat top-k")
        ax.set_ylabel("indexer speedup vs flat")
        ax.set_title(f"{result['model']}, L = {length['length']}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_list(kind):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="a pretrained model with its warmed indexer (default: the shipped one)")
    p.add_argument("--checkpoint", default=None, help="the shipped model's folder")
    p.add_argument("--lengths", type=parse_list(int), default=[16384, 32768])
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--budgets", type=parse_list(int), default=None,
                   help="fixed budgets in tokens (default: 2, 4, 8, 16, 32 x top_k)")
    p.add_argument("--masses", type=parse_list(float), default=[0.5, 0.7, 0.8, 0.9, 0.95])
    p.add_argument("--mass-max", type=int, default=None,
                   help="the mass rule's maximum budget in tokens (default: 16 x top_k)")
    p.add_argument("--mass-buckets", type=parse_list(float), default=[0.125, 0.25, 0.5, 1.0],
                   help="fractions of --mass-max the mass rule's chunks can run at")
    p.add_argument("--ratios", type=parse_list(float), default=[0.05, 0.1, 0.2])
    p.add_argument("--extra", type=parse_extra, default=[], metavar="NAME:FIELD=VALUE,...;...",
                   help="more HierarchicalConfig variants over the base, one row each")
    p.add_argument("--methods", type=parse_list(str), default=None,
                   help="coarse scorers (default: mean, and learned when trained screens "
                        "exist)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--flat-chunk", type=int, default=128)
    p.add_argument("--flat-threshold", action=argparse.BooleanOptionalAction, default=True,
                   help="also time flat ranked by threshold (FlatConfig.fast_ranking: no sort, "
                        "the default main job's flat), an exact path speedups can be against")
    p.add_argument("--offset", type=int, default=0,
                   help="the first held-out token of each length's window (another window "
                        "of the same text)")
    p.add_argument("--streaming-tiles", type=parse_list(int), default=[STREAMING_KEY_TILE],
                   help="key tiles of the streaming flat selection, one row each ('' for "
                        "none)")
    p.add_argument("--reuse", type=parse_list(str), default=[], metavar="PATTERN,...",
                   help="selection reuse across layers, one row per pattern and exact path "
                        "or fixed budget: freqN (layers 0, N, 2N, ... run their indexer) or "
                        "an F/S string per layer")
    add_out_argument(p, "frontier")
    args = p.parse_args(argv)
    if args.queries < 1 or args.repeats < 1 or not args.lengths or args.offset < 0:
        p.error("--queries and --repeats must be >= 1, --offset >= 0 and --lengths non-empty")
    if any(not 0 < m <= 1 for m in args.masses) or any(not 0 < r <= 1 for r in args.ratios):
        p.error("--masses and --ratios must be in (0, 1]")
    enable_compile_cache()
    t0 = time.monotonic()
    source = load_source(model_name=args.model, checkpoint=args.checkpoint,
                         max_length=max(args.lengths), attention="sparse", indexer="flat")
    model = source.model
    top_k, base = model.config.top_k, model.config.hierarchical
    args.block_size = base.block_size
    args.budgets = args.budgets or [top_k * f for f in (2, 4, 8, 16, 32)]
    if min(args.budgets) < top_k:
        p.error(f"--budgets must be >= top_k ({top_k})")
    args.mass_max = args.mass_max or 16 * top_k
    trained = has_coarse_screen(source.directory)
    methods = args.methods or (["mean", "learned"] if trained else ["mean"])
    if "learned" in methods and not trained:
        p.error(f"{source.directory} has no trained coarse screens: run python -m "
                f"experiments.training.coarse_screen first")
    runs = variants(base, args, methods)
    for pattern in args.reuse:
        try:
            model.config.replace(indexer_types=reuse_types(pattern))
        except ValueError as e:
            p.error(f"--reuse {pattern}: {e}")
    result = dict(
        command=recorded_command("experiments.benchmarks.frontier", argv), model=source.name,
        indexer=display_path(source.directory), indexer_sha256=source.indexer_sha256, top_k=top_k,
        block_size=base.block_size, queries=args.queries, offset=args.offset,
        layers=model.config.n_layers,
        machine=machine_description(), python=platform.python_version(),
        jax=jax.__version__, base_config=base.to_dict(), lengths=[])
    for L in args.lengths:
        n = min(args.queries, L)
        tokens = eval_sequence(source.heldout_tokens, L, offset=args.offset)
        layers = model_indexer_inputs(model, tokens, n)
        print(f"L={L}: indexer inputs of {len(layers)} layers captured "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        per_layer, selections = [], []
        for i, (q, w, k) in enumerate(layers):
            screen = model.layer(i).coarse_screen.params()
            res, kept = bench_layer(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), top_k,
                                    L - n, runs, screen, args)
            per_layer.append(res)
            selections.append(kept)
            print(f"  layer {i} done ({time.monotonic() - t0:.0f} s)", flush=True)
        summary = summarize(L, per_layer, runs, args.streaming_tiles)
        summary["rows"] += reuse_rows(L, per_layer, selections, runs, args.reuse, model.config,
                                      summary["exact_s"][summary["fastest_exact"]])
        result["lengths"].append(summary)
        del selections
    result["wall_s"] = round(time.monotonic() - t0, 1)
    text = markdown(result)
    print(text)
    out = pathlib.Path(args.out)
    write_json(out / "frontier.json", result)
    (out / "frontier.md").write_text(text + "\n\nCommand: `" + result["command"] + "`\n")
    plot(result, out / "frontier.png")
    print(f"wrote {out}/frontier.json, frontier.md, frontier.png")


if __name__ == "__main__":
    main()
