"""What a TTFT study runs, known before it runs: the timed prefills of each length (every
mode, and the window baselines of their split) and the decode steps after them.

Every prefill of a study writes into a cache of one capacity (the longest length, its
decode steps and one untimed step), so the chunks a shorter prefill runs are the first
chunks of a longer one: they share their programs, and each program is compiled once, for
the first length that runs it, before that length is timed. `rehearse` compiles the same
programs for a GPU here (experiments.gpu_targets), without weights: the study's
`--compile-only --target`.
"""

import dataclasses

import jax
import numpy as np

from model import ModelRunner
from model.buckets import cache_positions
from model.cache import init_cache
from model.runner import step_key

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Prefill:
    """One timed prefill of n tokens: a mode (`label` its name) or a window baseline."""

    label: str
    config: object  # the ModelConfig it runs
    n: int
    capacity: int
    logits_from: int | None = None
    capture: tuple = ()
    capture_from: int | None = None

    def kwargs(self):
        return dict(capacity=self.capacity, exact=True, logits_from=self.logits_from,
                    capture=self.capture, capture_from=self.capture_from)


@dataclasses.dataclass
class LengthPlan:
    """modes: name -> (ModeSpec, Prefill), the reference first; baselines: (top_k,
    prefill_chunk) -> Prefill; skipped: name -> why; decode: the decode positions;
    untimed: the modes run once for their fidelity only (ModeSpec.time_max_length)."""

    length: int
    modes: dict
    baselines: dict
    skipped: dict
    decode: range
    untimed: frozenset = frozenset()

    def prefills(self):
        return [p for _, p in self.modes.values()] + list(self.baselines.values())


def study_capacity(run):
    """Positions every cache of the study holds: the longest prefill and its decode steps
    (made exact: model.buckets.cache_positions rounds 8197 to 8448, not 16384)."""
    return max(run.lengths) + run.decode_steps + 1


def window_config(config, top_k):
    """`config` with indexer="window" reading `top_k` tokens per query: the selection-free
    baselines of the split."""
    return config.replace(attention="sparse", indexer="window", flat_index_layers=(),
                          top_k=top_k)


def baseline_keys(config, sparse):
    """The window baselines a mode's split needs, as (top_k, prefill_chunk): what a
    baseline's cost depends on."""
    keys = [(1, config.prefill_chunk)]
    if sparse:
        keys.insert(0, (config.top_k, config.prefill_chunk))
    return keys


def plan_length(run, base_config, length, modes=None):
    """The LengthPlan of `length` over the model config `base_config`; `modes`: the names
    to plan (default every mode of the run; the study passes those that compiled, for the
    baselines)."""
    capacity, P = study_capacity(run), run.fidelity_positions
    if cache_positions(capacity, exact=True) > base_config.max_seq_len:
        raise ValueError(f"the study's caches hold {capacity} positions (its longest length "
                         f"{max(run.lengths)}, {run.decode_steps} decode steps and one more), "
                         f"{cache_positions(capacity, exact=True)} as allocated, over the "
                         f"model's "
                         f"max_seq_len={base_config.max_seq_len}: raise max_seq_len or "
                         f"shorten the lengths")
    planned, skipped, baselines = {}, {}, {}
    for spec in sorted(run.modes, key=lambda m: m.name != run.reference):
        if modes is not None and spec.name not in modes:
            continue
        if spec.max_length is not None and length > spec.max_length:
            skipped[spec.name] = f"max_length {spec.max_length}"
            continue
        config = spec.model_config(base_config)
        # DeepSeek-V4's CSA indexer scores compressed entries: its passes capture only what
        # they selected (measure.selection_overlap compares those).
        capture = (() if not spec.sparse else ("indices",) if config.v4 is not None
                   else ("indexer", "indices"))
        planned[spec.name] = (spec, Prefill(spec.name, config, length, capacity,
                                            logits_from=length - P, capture=capture,
                                            capture_from=length - P))
        if not spec.timed(length) or not run.split:
            continue  # no split without timing, or when the run asks for none
        for key in baseline_keys(config, spec.sparse):
            baselines.setdefault(key, Prefill(f"window top_k {key[0]}",
                                              window_config(config, key[0]), length, capacity))
    decode = range(length, length + run.decode_steps + 1) if run.decode_steps else range(0)
    untimed = frozenset(name for name, (spec, _) in planned.items() if not spec.timed(length))
    return LengthPlan(length, planned, baselines, skipped, decode, untimed)


def cache_bytes(config, capacity):
    cache = jax.eval_shape(lambda: init_cache(config, cache_positions(capacity, exact=True)))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(cache))


def rehearse(run, base_config, target, *, log=print):
    """Every program of the study compiled for `target` (a GpuTarget) here, each once ->
    {"executables": one row each, "summary": count, compile seconds, peaks}. A row's peak
    is the program's (arguments, temporaries, outputs, its own cache among them); `held`
    adds what the study keeps on the device beside it at its first length: the other
    modes' last caches (kept for their decode steps) and the reference's cache copy (kept
    for the comparisons)."""
    from experiments.gpu_targets import peak_bytes

    runners, rows, seen = {}, [], {}
    capacity = study_capacity(run)
    for length in run.lengths:
        plan = plan_length(run, base_config, length)
        # While a prefill runs, each other mode holds its last cache (for its decode steps)
        # and the reference its copy (for the comparisons); a baseline keeps nothing.
        caches = {name: cache_bytes(p.config, capacity) for name, (_, p) in plan.modes.items()}
        copy = caches.get(run.reference, 0)
        steps = [(p, "prefill", s) for p in plan.prefills()
                 for s in _runner(runners, p.config).prefill_steps(p.n, **p.kwargs())]
        steps += [(p, "decode", s) for name, (_, p) in plan.modes.items()
                  if name not in plan.untimed
                  for s in _runner(runners, p.config).decode_steps(plan.decode, capacity,
                                                                   exact=True)]
        for prefill, kind, step in steps:
            key = (prefill.config, step_key(step))
            if key in seen:
                seen[key]["lengths"].append(length)
                continue
            runner = runners[prefill.config]
            compiled, seconds = target.compile(
                lambda place, runner=runner, step=step: runner.lower_step(*step, place=place))
            rows_, kv_len, all_logits, capture = key[1]
            peak = peak_bytes(compiled)
            held = sum(caches.values()) - caches.get(prefill.label, 0) + copy
            row = {"program": prefill.label, "step": kind, "lengths": [length],
                   "rows": rows_, "kv_len": kv_len, "all_logits": all_logits,
                   "capture": list(capture), "compile_s": round(seconds, 2),
                   "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                   "peak_bytes": peak, "held_bytes": peak + held}
            seen[key] = row
            rows.append(row)
            log(f"{length:>7} {prefill.label:<22} {kind:<7} rows {rows_:>5} keys {kv_len:>7}"
                f"{' logits' if all_logits else ''}{' capture' if capture else ''}: compile "
                f"{seconds:5.1f} s, peak {peak / GIB:6.2f} GiB (with what is held "
                f"{(peak + held) / GIB:6.2f})")
    limit = 0.9 * target.memory_bytes
    summary = {"target": target.name, "device_bytes": target.memory_bytes,
               "executables": len(rows),
               "compile_s": round(sum(r["compile_s"] for r in rows), 1),
               "peak_bytes": max(r["peak_bytes"] for r in rows),
               "held_bytes": max(r["held_bytes"] for r in rows),
               "fits": all(r["peak_bytes"] <= limit for r in rows),
               "fits_with_held": all(r["held_bytes"] <= limit for r in rows)}
    return {"executables": rows, "summary": summary}


def _runner(runners, config):
    if config not in runners:
        runners[config] = ModelRunner.abstract(config)
    return runners[config]
