"""The TTFT study: every mode at every length, then the comparisons and the summary."""

import dataclasses
import platform
import time

import jax
import numpy as np
from flax import nnx

from experiments.common import CompileCounter, display_path, release_programs
from experiments.data import Corpus, eval_sequence
from experiments.evaluation.metrics import pair_metrics
from experiments.ttft import plan
from experiments.ttft.machine_rate import add_rates, matmul_rate, model_flops
from experiments.ttft.measure import (
    TimedPrefill,
    harvest,
    mode_row,
    perplexity,
    scored_share,
    selection_overlap,
    time_interleaved,
    untimed_row,
)
from model import (
    ModelRunner,
    Transformer,
    default_checkpoint_dir,
    get_config,
    has_checkpoint,
    length_bucket,
    load_default_model,
    with_config,
)
from model.checkpoint import read_config
from model.config import keep_layers

METHOD = {
    "ttft": "prefill start to the first token on the host (last logits ready, argmax), after "
            "a compile-only warm-up (every program compiled once, before its first length "
            "is timed: the compiles while timed are counted, 0); every prefill into a fresh "
            "cache of the study's one capacity (the longest length and its decode steps), "
            "allocated before the clock starts; with several repetitions every mode and "
            "baseline of a length timed interleaved (each repetition runs each once), with "
            "one each timed right after its warm-up and its programs freed after it; min "
            "and median over the repetitions, ratios and the split from the min",
    "split": "TTFT differences of the same model (mins), baselines measured once per length: "
             "indexer = TTFT - TTFT with indexer='window' (each query reads the top_k tokens "
             "before it: the same attention, no selection scoring); attention = that window "
             "baseline - the window baseline with top_k = 1 (dense: TTFT - the top_k = 1 "
             "baseline); other = the top_k = 1 baseline (projections, MLP, caches, logits)",
    "fidelity": "teacher-forced over the last fidelity_positions positions of the same text: "
                "greedy top-1 agreement and mean KL(P_reference || P_mode) of the next-token "
                "distributions; recall and IoU of the mode's selection against the "
                "reference's on the reference pass's own indexer inputs (last positions, all "
                "layers)",
    "decode": "median wall time of one decode step right after the prefill (greedy)",
    "achieved rate": "the mode's model FLOPs at that length (model.costs, causal pairs: "
                     "the layers' linear work, attention over each query's selection or "
                     "every causal key, the selection as its kind scores) over its fastest "
                     "TTFT; its share of the machine's f32 matmul rate on the model's MLP "
                     "shape, measured in the same process before the first length and "
                     "after the last (the larger)",
}


def preset_config(source, capacity):
    """The ModelConfig of a preset source (model.preset, its layers, its overrides: a
    section such as moe or hierarchical given as a mapping changes only the fields it
    names) holding contexts of `capacity` tokens. ValueError naming a bad field or layer."""
    preset = get_config(source.preset)
    if source.layers is not None:
        preset = keep_layers(preset, source.layers)
    overrides = dict(source.overrides)
    for key, value in overrides.items():  # a section's fields change, the rest are kept
        section = getattr(preset, key, None)
        if isinstance(value, dict) and dataclasses.is_dataclass(section):
            overrides[key] = section.replace(**value)
    overrides.setdefault("max_seq_len", max(length_bucket(capacity), preset.max_seq_len))
    return preset.replace(**overrides)


def load_source(source, capacity):
    """-> (model, description, random_weights, held-out token stream); the model holds
    contexts of `capacity` tokens. A checkpoint that is not there raises
    model.CheckpointMissingError (never a silent random model)."""
    overrides = dict(source.overrides)
    if source.random_weights:
        model = Transformer(preset_config(source, capacity), rngs=nnx.Rngs(0))
        kept = "" if source.layers is None else f", layers {list(source.layers)}"
        return (model, f"preset {source.preset}{kept}, random weights (text: held-out "
                       f"standard-library sources)", True, Corpus().heldout_tokens)
    if source.pretrained is not None:
        from experiments.text_corpus import heldout_text_tokens
        from model.pretrained import load_pretrained

        overrides.setdefault("max_seq_len", length_bucket(capacity))
        pre = load_pretrained(source.pretrained, **overrides)
        indexer = display_path(pre.info["indexer"])
        if pre.info.get("indexer_sha256"):  # the folder's weights change when one is shipped
            indexer += f", sha256 {pre.info['indexer_sha256'][:8]}"
        return (pre.model, f"pretrained {source.pretrained} (indexer: {indexer}; text: "
                           f"held-out Python documentation, pydoc topics)",
                False, heldout_text_tokens(pre.tokenizer))
    directory = source.checkpoint or default_checkpoint_dir()
    if "max_seq_len" not in overrides and has_checkpoint(directory):
        stored, _ = read_config(directory)  # the stored length, without loading the weights
        overrides["max_seq_len"] = max(length_bucket(capacity), stored.max_seq_len)
    model, metadata = load_default_model(directory, **overrides)
    step = (metadata.get("training") or {}).get("total_steps")
    name = source.checkpoint or "checkpoints/small"
    corpus = Corpus(heldout_fraction=float(metadata.get("data", {}).get("heldout_fraction",
                                                                        0.05)))
    return (model, f"checkpoint {name} (step {step}; text: held-out standard-library sources)",
            False, corpus.heldout_tokens)


def source_config(source, capacity):
    """(ModelConfig, description) of a run's model, as load_source would make it, without
    making its weights (--compile-only); a pretrained source is loaded (its config comes
    with its weights)."""
    if source.random_weights:
        return preset_config(source, capacity), f"preset {source.preset}, no weights"
    if source.pretrained is not None:
        model, description, _, _ = load_source(source, capacity)
        return model.config, description
    directory = source.checkpoint or default_checkpoint_dir()
    if not has_checkpoint(directory):
        load_default_model(directory)  # raises CheckpointMissingError, naming the fix
    stored, _ = read_config(directory)
    overrides = {"max_seq_len": max(length_bucket(capacity), stored.max_seq_len),
                 **source.overrides}
    return stored.replace(**overrides), f"checkpoint {source.checkpoint or 'checkpoints/small'}"


def _skipped(length, spec, reason):
    return {"context_len": length, "mode": spec.name, "skipped": reason, "ttft_ms": None,
            "indexer_ms": None, "attention_ms": None, "other_ms": None,
            "indexer_share": None, "recall": None, "iou": None, "top1_agreement": None,
            "logit_kl": None}


def _out_of_memory(error):
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error)


def compare(run, runs, model_config, random_weights, tokens):
    """Fills each row's fidelity figures from the ModeRuns of one length (in place):
    against the reference and against dense, perplexity over the fidelity positions, and
    the hierarchical stage's scored share."""
    ref = runs.get(run.reference)
    dense = next((r for name, r in runs.items() if run.mode(name).attention == "dense"), None)
    for mode_run in runs.values():
        if not random_weights and mode_run.tail_logprobs is not None:
            mode_run.row["perplexity"] = perplexity(mode_run.tail_logprobs, tokens)
    for name, mode_run in runs.items():
        row, spec = mode_run.row, run.mode(name)
        if spec.sparse:
            row["scored_share"] = scored_share(spec.model_config(model_config), len(tokens),
                                               run.fidelity_positions)
        if random_weights or mode_run.tail_logprobs is None:
            continue
        if dense is not None and mode_run is not dense:
            row["perplexity_vs_dense"] = row["perplexity"] / dense.row["perplexity"] - 1
        if ref is not None and name != run.reference:
            pair = pair_metrics(ref.tail_logprobs, mode_run.tail_logprobs)
            row.update(top1_agreement=pair["agreement"], logit_kl=pair["kl_mean"])
            if spec.sparse:
                row["recall"], row["iou"] = selection_overlap(
                    spec.model_config(model_config), ref, row["context_len"], mode_run)
        if dense is not None and mode_run is not dense:
            pair = pair_metrics(dense.tail_logprobs, mode_run.tail_logprobs)
            row.update(top1_agreement_vs_dense=pair["agreement"],
                       logit_kl_vs_dense=pair["kl_mean"])


def _comparison(run, L, ref, cmp):
    decode = None
    if ref.get("decode_step_ms") and cmp.get("decode_step_ms"):
        decode = cmp["decode_step_ms"]["median"] / ref["decode_step_ms"]["median"]
    return {"context_len": L, "reference": run.reference, "compare": run.compare,
            "ttft_ratio": cmp["ttft_ms"]["min"] / ref["ttft_ms"]["min"],
            "ttft_ratio_median": cmp["ttft_ms"]["median"] / ref["ttft_ms"]["median"],
            "indexer_share_flat": ref["indexer_share"],
            "indexer_share_hierarchical": cmp["indexer_share"],
            "recall": cmp["recall"], "iou": cmp["iou"],
            "top1_agreement": cmp["top1_agreement"], "logit_kl": cmp["logit_kl"],
            "top1_agreement_vs_dense": cmp.get("top1_agreement_vs_dense"),
            "logit_kl_vs_dense": cmp.get("logit_kl_vs_dense"),
            "perplexity_vs_dense": cmp.get("perplexity_vs_dense"),
            "reference_perplexity_vs_dense": ref.get("perplexity_vs_dense"),
            "scored_share": cmp.get("scored_share"), "decode_step_ratio": decode}


def summary(run, rows):
    """The comparison at the longest length where the reference and compare modes were
    timed, and the same figures at every such length (`per_length`)."""
    done = {(r["context_len"], r["mode"]): r for r in rows
            if not r.get("skipped") and r.get("ttft_ms") is not None}
    lengths = [L for L in sorted(run.lengths, reverse=True)
               if (L, run.reference) in done and (L, run.compare) in done]
    if not lengths:
        return {"context_len": None, "ttft_ratio": None, "indexer_share_flat": None,
                "indexer_share_hierarchical": None, "recall": None, "top1_agreement": None,
                "per_length": []}
    per_length = [_comparison(run, L, done[(L, run.reference)], done[(L, run.compare)])
                  for L in sorted(lengths)]
    return {**per_length[-1], "per_length": per_length}


def _time_length(run, model, tokens, compiles, *, progress, log):
    """Compiles every program of one length (plan.plan_length: every mode and the baselines
    of their split, their decode steps), times them, finishes each -> (ModeRuns by name,
    every mode's row, reference first, the compile counts).

    With several repetitions, every program is compiled first and the rounds are
    interleaved (measure.time_interleaved). With one, nothing is gained by holding every
    program at once, so each mode and baseline in turn is compiled, timed once and its
    prefill programs freed (release_programs) before its decode steps load and run: the
    study holds one mode's prefill programs or its decode steps, not all of them (an
    executable of SmolLM2's 30 layers holds 0.2-0.25 GB), and a program the next one
    shares comes back from the persistent compilation cache, not a compile."""
    length = len(tokens)
    planned = plan.plan_length(run, model.config, length)
    skipped = {name: _skipped(length, run.mode(name), why)
               for name, why in planned.skipped.items()}
    timed = [name for name in planned.modes if name not in planned.untimed]
    counts = {"programs": 0, "compiles_before_timing": 0, "compiles_while_timed": 0,
              "compiles_harvest": 0}
    timers, runs, by_timer = {}, {}, {}  # by_timer: id(a mode's TimedPrefill) -> its name
    compile_s = {}  # mode -> XLA compile seconds of its prefill programs at this length

    def make(name):  # a mode's TimedPrefill, compiled (None: it does not fit)
        spec, prefill = planned.modes[name]
        if progress:
            progress(f"{length} tokens, {name}: compiling")
        compiles.take_seconds()
        try:
            runner = ModelRunner(with_config(model, prefill.config))
            timer = TimedPrefill(runner, tokens, prefill)
            # With one repetition the decode steps compile after the pass, once its programs
            # are freed (harvest's untimed first step): held through the pass they added
            # 0.2-0.45 GB to the job's peak, the hierarchical 8K pass's.
            if run.decode_steps and name not in planned.untimed and run.repetitions > 1:
                runner.compile_decode(planned.decode, prefill.capacity, exact=True)
        except Exception as e:  # noqa: BLE001 - a run that does not fit is reported
            if not _out_of_memory(e):
                raise
            skipped[name] = _skipped(length, spec, f"out of memory: {str(e)[:200]}")
            log(f"{length:>7} {name:<22} skipped: out of memory")
            return None
        timers[name], by_timer[id(timer)] = (spec, prefill.config, timer), name
        counts["programs"] += timer.programs
        compile_s[name] = compiles.take_seconds()
        return timer

    def make_baseline(key, prefill):
        if progress:
            progress(f"{length} tokens, window baseline (top_k {key[0]}): compiling",
                     advance=False)
        timer = TimedPrefill(ModelRunner(with_config(model, prefill.config)), tokens, prefill,
                             keep_output=False)
        counts["programs"] += timer.programs
        return timer

    def take(timer):  # right after a mode's last pass: keep what the figures need
        name = by_timer.get(id(timer))
        if name is not None:
            counts["compiles_while_timed"] += compiles.take()
            runs[name] = harvest(timers[name][0], timer, run,
                                 keep_index=name == run.reference, decode=name in timed)
            counts["compiles_harvest"] += compiles.take()

    t0 = time.perf_counter()
    if run.repetitions > 1:
        for name in planned.modes:
            make(name)
        baselines = {key: make_baseline(key, prefill) for key, prefill in plan.plan_length(
            run, model.config, length, modes=timers).baselines.items()}
        counts["compiles_before_timing"] += compiles.take()
        if progress:
            progress(f"{length} tokens: {len(timers)} modes + {len(baselines)} baselines x "
                     f"{run.repetitions}, interleaved", advance=False)
        t0 = time.perf_counter()
        time_interleaved([timers[name][2] for name in timed if name in timers]
                         + list(baselines.values()), run.repetitions, after_last=take)
    else:
        baselines = {}

        def once(timer):
            counts["compiles_before_timing"] += compiles.take()
            timer.time_once()
            counts["compiles_while_timed"] += compiles.take()
            # A loaded executable of one of SmolLM2's 30-layer chunk steps holds 0.2-0.25 GB
            # of host memory (RSS per step loaded, not its temporaries): the prefill's are
            # freed before the decode steps load.
            release_programs()
            take(timer)
            release_programs()

        for name in timed:
            if (timer := make(name)) is not None:
                once(timer)
        for key, prefill in plan.plan_length(run, model.config, length,
                                             modes=timers).baselines.items():
            baselines[key] = timer = make_baseline(key, prefill)
            once(timer)
    wall = time.perf_counter() - t0
    counts["compiles_while_timed"] += compiles.take()
    for name in [n for n in planned.modes if n not in timed]:  # once, for the fidelity figures
        timer = timers[name][2] if name in timers else make(name)
        if timer is None:
            continue
        if progress:
            progress(f"{length} tokens, {name}: one untimed pass (fidelity)", advance=False)
        counts["compiles_before_timing"] += compiles.take()
        timer.time_once()
        release_programs()
        take(timer)
        release_programs()
    log(f"{length:>7} XLA compiles: {counts['compiles_before_timing']} before timing (of "
        f"the length's {counts['programs']} prefill programs, those no shorter length "
        f"compiled; its decode steps; its caches'), {counts['compiles_while_timed']} while "
        f"timed")
    for name, (spec, config, timer) in timers.items():
        if name not in timed:
            runs[name].row = untimed_row(spec, config, length)
            runs[name].row["compile_s"] = round(compile_s.get(name, 0.0), 2)
            log(f"{length:>7} {spec.name:<22} run once, untimed (fidelity only)")
            continue
        runs[name].row = row = mode_row(spec, config, timer, runs[name], baselines)
        row["compile_s"] = round(compile_s.get(name, 0.0), 2)
        row["model_tflop"] = model_flops(config, length) / 1e12
        # The length's timing per mode (decode steps within; with one repetition, compiles too).
        row["wall_s"] = wall / len(timed)
        t = row["ttft_ms"]
        share = row["indexer_share"]  # None without a split
        log(f"{length:>6} {spec.name[:22]:<22} TTFT {t['min'] / 1e3:7.2f} s (median "
            f"{t['median'] / 1e3:.2f})" + ("" if share is None else f", indexer {share:.2f}")
            + f"; compile {row['compile_s']:.1f} s")
    order = sorted(run.modes, key=lambda m: m.name != run.reference)
    rows = [skipped[m.name] if m.name in skipped else runs[m.name].row for m in order]
    return runs, rows, counts


def run_study(run, model, heldout_tokens, *, random_weights, progress=None, log=print):
    """-> (rows, summary). progress(description, advance=True) is called before each step;
    log(line) after each measured (length, mode). The machine's f32 matmul rate is measured
    before the first length and after the last (the summary's "matmul_rate": the larger is
    the limit each timed row's achieved rate is a share of, experiments.ttft.machine_rate).
    The summary's "compiles" counts XLA's compiles per length (before timing, while
    timed: 0) and in all (the persistent compilation cache's hits are not compiles)."""
    rows, compiles, counts = [], CompileCounter(), {}
    rates = [matmul_rate(model.config)]
    log(f"f32 matmul rate ({rates[0]['shape']}, the model's MLP): "
        f"{rates[0]['gflops']:.1f} GFLOP/s")
    compiles.take_seconds()
    for length in run.lengths:
        tokens = eval_sequence(heldout_tokens, length)
        runs, length_rows, counts[length] = _time_length(run, model, tokens, compiles,
                                                         progress=progress, log=log)
        compare(run, runs, model.config, random_weights, tokens)
        counts[length]["compiles_fidelity_and_decode"] = \
            counts[length].pop("compiles_harvest") + compiles.take()
        rows += length_rows
        del runs
    rates.append(matmul_rate(model.config))  # the machine's limit before and after
    rate = max(r["gflops"] for r in rates)
    add_rates(rows, rate)
    result = summary(run, rows)
    result["matmul_rate"] = {"gflops": round(rate, 2), "shape": rates[0]["shape"],
                             "measured_gflops": [round(r["gflops"], 2) for r in rates]}
    result["compiles"] = {"per_length": {str(L): c for L, c in counts.items()},
                          "total": sum(v for c in counts.values() for k, v in c.items()
                                       if k.startswith("compiles")),
                          "seconds": round(compiles.seconds, 1)}
    return rows, result


def environment():
    device = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": device.device_kind, "device_count": jax.device_count(),
            "python": platform.python_version(), "numpy": np.__version__}
