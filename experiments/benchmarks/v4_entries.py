"""Selection over DeepSeek-V4's compressed entries: hierarchical against flat, for recall
and output agreement on a V4 model over real text, and for time at V4-Flash's indexer
dimensions.

    python -m experiments.benchmarks.v4_entries [--model FOLDER] [--tokens 8192]
        [--budgets 128,256,512] [--block 16] [--top-k 0]
        [--contexts 32768,65536,131072] [--queries 1024] [--repeats 3] [--out DIR]

Two parts, both printed as tables and written to OUT/v4_entries.json (default
runs/v4_entries/):
- recall (`--model`, default the transformers-made tiny V4 fixture): the held-out text's
  first `--tokens` tokens prefilled once with every CSA layer on flat selection and once
  per hierarchical budget (`--budgets`, entries a query may rank; blocks of `--block`
  entries; `--top-k` 0 keeps the model's index_topk), each pass capturing the entries every
  row chose. Per budget: recall against flat (|hierarchical & flat| / |flat| over every row
  and CSA layer), the share of visible entries each query ranks (its candidates: the
  "scored" share) and the share the fine stage's dense products compute (its tile's union
  of candidates), and the agreement of the two passes' greedy next tokens over every
  position.
- timing (`--contexts`, positions; entries = positions / 4): the CSA indexer at
  V4-Flash's sizes (64 heads of 128, index_topk 512, ratio 4) on seeded random inputs
  (random keys have no block structure, so only the time is meaningful), the last
  `--queries` queries of a context, flat and hierarchical timed interleaved (median of
  `--repeats` rounds after a compile), with the hierarchical budget's scored share.
"""

import argparse
import pathlib

import jax
import numpy as np

from experiments.benchmarks.support import median_interleaved, random_inputs
from experiments.common import (
    add_out_argument,
    display_path,
    machine_description,
    parse_hierarchical,
    recorded_command,
    write_json,
)
from experiments.text_corpus import heldout_text_tokens
from indexer import HierarchicalConfig, flat_topk, hierarchical_topk_with_stats
from indexer.config import hierarchical_plan

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "tests/fixtures/deepseek_v4/tiny"
FLASH = dict(heads=64, dim=128, top_k=512, ratio=4)


def _csa_layers(config):
    return [i for i, kind in enumerate(config.v4.layer_types) if kind == "csa"]


def _shares(T, ratio, budget, union):
    """(candidates / visible, fine-stage union / visible) summed over the rows of a prefill
    of T tokens from position 0."""
    visible = (np.arange(T) + 1) // ratio
    seen = max(int(visible.sum()), 1)
    return (float(np.minimum(visible, budget).sum()) / seen,
            float(np.minimum(visible, union).sum()) / seen)


def recall_part(folder, n_tokens, budgets, block, top_k, settings_text=""):
    from model import ModelRunner, with_config
    from model.pretrained.registry import load_pretrained

    pretrained = load_pretrained(folder)
    model, tokenizer = pretrained.model, pretrained.tokenizer
    tokens = heldout_text_tokens(tokenizer)[:n_tokens]
    if len(tokens) < n_tokens:
        raise ValueError(f"--tokens: the held-out text has {len(tokens)} tokens under this "
                         f"tokenizer, asked for {n_tokens}")
    base = model.config.replace(top_k=top_k or model.config.top_k)
    layers, ratio = _csa_layers(base), base.v4.csa_ratio

    def run(config):
        logits, _, captured = ModelRunner(with_config(model, config)).prefill(
            tokens, logits_from=0, chunk=2048, capture=("indices",))
        return (np.asarray(logits).argmax(-1),
                {i: np.asarray(captured["indices"][i]) for i in layers})

    flat_tokens, flat = run(base.replace(indexer="flat"))
    rows = []
    for budget in budgets:
        settings = parse_hierarchical(settings_text, HierarchicalConfig(
            block_size=block, candidate_tokens=budget, fine_batch_size=256))
        got_tokens, got = run(base.replace(indexer="hierarchical", hierarchical=settings))
        hit = total = 0
        for i in layers:
            for a, b in zip(got[i], flat[i]):
                want = set(b[b >= 0].tolist())
                hit += len(want & set(a[a >= 0].tolist()))
                total += len(want)
        plan = hierarchical_plan(settings, 2048, len(tokens) // ratio, base.top_k,
                                 base.index_heads)
        scored, computed = _shares(len(tokens), ratio, plan.n_cand * block,
                                   plan.n_union * block)
        rows.append(dict(budget_entries=budget, block_entries=block, settings=settings_text,
                         recall=hit / max(total, 1), scored_share=scored,
                         fine_stage_share=computed,
                         greedy_agreement=float(np.mean(got_tokens == flat_tokens))))
    return dict(model=display_path(folder), family=pretrained.info["family"],
                tokens=len(tokens), entries=len(tokens) // ratio, csa_layers=layers,
                top_k=base.top_k, ratio=ratio, rows=rows)


def _time_one(context, n_queries, repeats, settings):
    """One context's row: flat and hierarchical on the same random inputs, interleaved."""
    ratio, top_k = FLASH["ratio"], FLASH["top_k"]
    n_entries = context // ratio
    q, w, k, _ = random_inputs(context, n_entries, n_queries, FLASH["heads"], FLASH["dim"])
    q_offset = context - n_queries
    flat = jax.jit(lambda q, w, k: flat_topk(q, w, k, top_k, q_offset=q_offset,
                                              key_ratio=ratio))
    hier = jax.jit(lambda q, w, k: hierarchical_topk_with_stats(
        q, w, k, top_k, settings, q_offset=q_offset, key_ratio=ratio))
    _, stats = jax.block_until_ready(hier(q, w, k))  # compiles
    jax.block_until_ready(flat(q, w, k))
    times = median_interleaved({"flat": lambda: flat(q, w, k),
                                "hierarchical": lambda: hier(q, w, k)}, repeats)
    return dict(context=context, entries=n_entries, queries=n_queries,
                flat_s=times["flat"], hierarchical_s=times["hierarchical"],
                speedup=times["flat"] / times["hierarchical"],
                scored_share=float(stats["scored_fraction"]))


def timing_part(contexts, n_queries, repeats, budget, block, settings_text=""):
    settings = parse_hierarchical(settings_text, HierarchicalConfig(block_size=block,
                                                                    candidate_tokens=budget))
    rows = [_time_one(context, n_queries, repeats, settings) for context in contexts]
    return dict(indexer=FLASH, budget_entries=budget, block_entries=block,
                settings=settings_text, rows=rows)


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(FIXTURE), help="a V4 folder (default: the fixture)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--budgets", type=_ints, default=[128, 256, 512])
    p.add_argument("--block", type=int, default=16, help="entries per hierarchical block")
    p.add_argument("--top-k", type=int, default=0, help="0: the model's index_topk")
    p.add_argument("--settings", default="", metavar="FIELD=VALUE,...",
                   help="more HierarchicalConfig fields (both parts)")
    p.add_argument("--contexts", type=_ints, default=[32768, 65536, 131072])
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timing-budget", type=int, default=2048,
                   help="entries a query ranks in the timing part")
    p.add_argument("--parts", default="recall,timing")
    add_out_argument(p, "v4_entries")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    result = dict(command=recorded_command("experiments.benchmarks.v4_entries", argv),
                  machine=machine_description())
    if "recall" in parts:
        rec = recall_part(pathlib.Path(args.model), args.tokens, args.budgets, args.block,
                          args.top_k, args.settings)
        result["recall"] = rec
        print(f"recall: {rec['model']} ({rec['family']}), {rec['tokens']} tokens = "
              f"{rec['entries']} entries per CSA layer {rec['csa_layers']}, top_k {rec['top_k']}")
        print("budget  block  recall  scored  fine-stage  greedy agreement")
        for r in rec["rows"]:
            print(f"{r['budget_entries']:6d}  {r['block_entries']:5d}  {r['recall']:.4f}  "
                  f"{r['scored_share']:.3f}   {r['fine_stage_share']:.3f}      "
                  f"{r['greedy_agreement']:.4f}")
    if "timing" in parts:
        tim = timing_part(args.contexts, args.queries, args.repeats, args.timing_budget,
                          args.block, args.settings)
        result["timing"] = tim
        print(f"timing: V4-Flash indexer {FLASH}, random inputs, last {args.queries} queries, "
              f"budget {args.timing_budget} entries in blocks of {args.block}")
        print("context  entries  flat s  hierarchical s  speedup  scored")
        for r in tim["rows"]:
            print(f"{r['context']:7d}  {r['entries']:7d}  {r['flat_s']:6.2f}  "
                  f"{r['hierarchical_s']:14.2f}  {r['speedup']:6.2f}x  {r['scored_share']:.3f}")
    path = pathlib.Path(args.out) / "v4_entries.json"
    write_json(path, result)
    print(f"wrote {display_path(path)}")
    return result


if __name__ == "__main__":
    main()
