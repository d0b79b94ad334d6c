"""Baselines computed once: the dense and oracle passes of a retrieval probe, kept per probe
kind and length and reused by every later evaluation of a sparse method on the same
sequences (they do not depend on the indexer being evaluated).

A baseline file (results/pretrained/baselines/<kind>_<L>.json) records what its sequences
and passes depend on: the probe kind, length, probes per sequence, the seed, the model's
base file (name and SHA-256) and the config fields the dense and oracle passes read (top_k,
dense_layers, rope_scaling). A later run uses a method's per-probe scores only when every
one of them matches and the file holds at least as many sequences as asked (sequence i is
the same sequence in every run: its seed is seed * 1000 + L + i); otherwise it says which
field differs and computes the pass itself.

    python -m experiments.evaluation.baselines --from-eval DIR [--out results/pretrained/baselines]

adopts the dense / oracle rows of an earlier `experiments.evaluation.pretrained` run.
"""

import argparse
import json
import pathlib

import numpy as np

from experiments.common import display_path, write_json
from model.pretrained.registry import file_sha256

BASELINE_METHODS = ("dense", "oracle")
DEFAULT_DIR = pathlib.Path("results/pretrained/baselines")
_SHA = {}


def _sha256(path):
    path = str(path)
    if path not in _SHA:
        _SHA[path] = file_sha256(path)
    return _SHA[path]


def baseline_key(*, kind, length, per_sequence, seed, model_path, config):
    """What a baseline's sequences and passes depend on (a JSON-able dict)."""
    path = pathlib.Path(model_path)
    return dict(kind=kind, length=int(length), per_sequence=int(per_sequence), seed=int(seed),
                model_file=path.name, model_sha256=_sha256(path) if path.is_file() else None,
                top_k=int(config.top_k), dense_layers=list(config.dense_layers),
                rope_scaling=config.rope_scaling)


def baseline_path(directory, key):
    return pathlib.Path(directory) / f"{key['kind']}_{key['length']}.json"


def load_baseline(directory, key, method, sequences, log=print):
    """(scores, n): `method`'s per-probe scores on the first n <= `sequences` sequences the
    baseline file holds for `key` (sequence i is built from seed and i alone, so a stored
    prefix is valid for a longer run, which computes only the rest), or (None, 0), logged
    why."""
    path = baseline_path(directory, key)
    if not path.exists():
        return None, 0
    saved = json.loads(path.read_text())
    differ = [f"{k} {saved['key'].get(k)!r} != {v!r}" for k, v in key.items()
              if saved["key"].get(k) != v]
    entry = saved["methods"].get(method)
    if differ or entry is None:
        why = ", ".join(differ) if differ else "no such method"
        log(f"baseline {display_path(path)} not used for {method}: {why}")
        return None, 0
    n = min(entry["sequences"], sequences)
    if n < sequences:
        log(f"baseline {display_path(path)} holds {entry['sequences']} sequences of "
            f"{method}; computing the other {sequences - n}")
    return entry["scores"][:n * key["per_sequence"]], n


def save_baseline(directory, key, method, scores, sequences, *, command, wall_s):
    """Writes (or extends with) `method`'s per-probe scores (floats, or [teacher-forced,
    exact] pairs for needles)."""
    path = baseline_path(directory, key)
    saved = json.loads(path.read_text()) if path.exists() else None
    if saved is None or saved["key"] != key:
        saved = dict(key=key, methods={})
    saved["methods"][method] = dict(sequences=int(sequences),
                                    scores=np.asarray(scores, float).tolist(),
                                    command=command, wall_s=wall_s)
    write_json(path, saved)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description="Adopt the dense / oracle rows of an earlier "
                                "evaluation as baselines")
    p.add_argument("--from-eval", required=True, metavar="DIR",
                   help="an experiments.evaluation.pretrained output folder (eval.json)")
    p.add_argument("--model-path", required=True,
                   help="the model's base file the run read (its SHA-256 is recorded; the "
                        "run's info.path names it)")
    p.add_argument("--out", default=str(DEFAULT_DIR))
    args = p.parse_args(argv)
    report = json.loads((pathlib.Path(args.from_eval) / "eval.json").read_text())
    cfg = report["config"]

    class Config:  # the fields baseline_key reads
        top_k, dense_layers, rope_scaling = cfg["top_k"], cfg["dense_layers"], cfg["rope_scaling"]

    if pathlib.Path(args.model_path).name != pathlib.Path(report["info"]["path"]).name:
        p.error(f"--model-path {args.model_path} is not the run's model file "
                f"{report['info']['path']}")
    seed = report.get("seed", 0)  # runs before the seed was recorded used the default
    for r in report["lengths"]:
        pk = r.get("retrieval")
        if not pk:
            continue
        key = baseline_key(kind=pk["kind"], length=r["length"], per_sequence=pk["per_sequence"],
                           seed=seed, model_path=args.model_path, config=Config)
        for method in BASELINE_METHODS:
            if method in pk:
                path = save_baseline(args.out, key, method, pk[method]["scores"],
                                     pk["sequences"], command=report["command"],
                                     wall_s=pk[method].get("wall_s"))
                print(f"{method} L={r['length']} {pk['kind']}: {pk['sequences']} sequences "
                      f"-> {display_path(path)}")


if __name__ == "__main__":
    main()
