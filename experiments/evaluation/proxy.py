"""The quick proxy for iterating on an indexer: three figures that track the full retrieval
table (docs/pretrained.md) at a fraction of its cost.

    python -m experiments.evaluation.proxy --model smollm2-135m [--indexer-dir DIR] \
        [--method sparse_flat] [--out runs/proxy]

1. the indexer's held-out KL on an 8192-token window of the pydoc text (the warm-up's own
   held-out loss, experiments.training.warmup, at 8K);
2. the copy probe (words from the context's own vocabulary) at 2K on 40 sequences and at
   4K on 16, the method paired with dense on the same sequences; dense comes from the
   committed baselines (experiments.evaluation.baselines; computed and written there when
   missing).

JSON to OUT/proxy.json, a table to OUT/proxy.md; the evaluation runs' own outputs in
OUT/copy_<L>.
"""

import argparse
import json
import pathlib
import time

import jax

from experiments.common import add_out_argument, display_path, write_json
from experiments.evaluation import pretrained
from experiments.evaluation.baselines import DEFAULT_DIR
from experiments.text_corpus import heldout_text_tokens
from experiments.training import steps as ts
from experiments.training.warmup import HELDOUT_OFFSET
from model.pretrained import load_pretrained


def heldout_kl(model_name, indexer_dir, length):
    """The indexer's KL to the dense attention target on the held-out window (the warm-up's
    held-out loss) -> (KL, seconds, the loaded model's info: its indexer folder and digest)."""
    t = time.monotonic()
    pre = load_pretrained(model_name, indexer_dir=indexer_dir, attention="dense")
    window = heldout_text_tokens(pre.tokenizer)[HELDOUT_OFFSET:HELDOUT_OFFSET + length][None]
    graphdef, main_p, idx_p, rest = ts.split_model(pre.model)
    trainable, frozen = ts.trainable_of("indexer_warmup", main_p, idx_p)
    kl = float(ts.make_eval_loss(graphdef, "indexer_warmup")(trainable, frozen, rest, window))
    jax.clear_caches()
    return kl, round(time.monotonic() - t, 1), pre.info


def parse_copy(text):
    """"2048:40,4096:16" -> [(2048, 40), (4096, 16)]."""
    out = []
    for part in text.split(","):
        length, _, n = part.partition(":")
        if not (length.strip().isdigit() and n.strip().isdigit()):
            raise ValueError(f"--copy takes LENGTH:SEQUENCES,..., got {text!r}")
        out.append((int(length), int(n)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--indexer-dir", default="default")
    p.add_argument("--method", default="sparse_flat", choices=pretrained.METHODS[1:])
    p.add_argument("--kl-length", type=int, default=8192)
    p.add_argument("--copy", default="2048:40,4096:16", metavar="L:N,...",
                   help="copy-probe lengths and sequence counts")
    p.add_argument("--baselines", default=str(DEFAULT_DIR))
    p.add_argument("--hierarchical", default=None, metavar="FIELD=VALUE,...")
    add_out_argument(p, "proxy")
    args = p.parse_args(argv)
    copies = parse_copy(args.copy)
    out = pathlib.Path(args.out)
    t0 = time.monotonic()
    indexer_dir = None if args.indexer_dir == "none" else args.indexer_dir
    kl, kl_s, info = heldout_kl(args.model, indexer_dir, args.kl_length)
    print(f"held-out KL at {args.kl_length}: {kl:.4f} ({kl_s} s)", flush=True)
    indexer = info["indexer"] if info["indexer"] == "fresh" else display_path(info["indexer"])
    report = dict(model=args.model, indexer=indexer, indexer_sha256=info.get("indexer_sha256"),
                  method=args.method,
                  heldout_kl=dict(length=args.kl_length, kl=round(kl, 5), wall_s=kl_s), copy=[])
    for length, n in copies:
        run = out / f"copy_{length}"
        argv_eval = ["--model", args.model, "--indexer-dir", args.indexer_dir,
                     "--retrieval-only", "--probe", "copy", "--lengths", str(length),
                     "--probe-sequences", str(n), "--methods", f"dense,{args.method}",
                     "--baselines", args.baselines, "--write-baselines", "--out", str(run)]
        if args.hierarchical:
            argv_eval += ["--hierarchical", args.hierarchical]
        pretrained.main(argv_eval)
        evaluation = json.loads((run / "eval.json").read_text())
        # The setting the probes ran at (the indexer's own top_k unless told), for readers
        # such as experiments.evaluation.full_table.
        report["config"] = {k: evaluation["config"].get(k)
                            for k in ("top_k", "dense_layers", "index_rope_scaling")}
        r = evaluation["lengths"][0]["retrieval"]
        m, d = r[args.method], r["dense"]
        report["copy"].append(dict(
            length=length, sequences=n, dense=d["token_accuracy"], method=m["token_accuracy"],
            vs_dense=m["token_vs_dense"], vs_dense_ci95=m["token_vs_dense_ci95"],
            wall_s=m["wall_s"], dense_source=d["source"]))
    report["wall_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "proxy.json", report)
    lines = [f"# Quick proxy: {args.model}, {args.method}, indexer {indexer}", "",
             f"- held-out KL at {args.kl_length}: {kl:.4f} ({kl_s} s)"]
    for c in report["copy"]:
        lo, hi = c["vs_dense_ci95"]
        lines.append(f"- copy at {c['length']} ({c['sequences']} sequences): {c['method']:.1%} "
                     f"vs dense {c['dense']:.1%}, {c['vs_dense']:+.1%} [{lo:+.1%}, {hi:+.1%}] "
                     f"({c['wall_s']} s; dense {c['dense_source']})")
    lines += ["", f"Wall time {report['wall_s']} s.", ""]
    (out / "proxy.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {display_path(out)}")


if __name__ == "__main__":
    main()
