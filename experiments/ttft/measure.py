"""Measuring the modes of one context length: TTFT, its split, decode steps, fidelity.

TTFT is prefill start to first token available (the last position's logits ready and
argmax'd on the host), timed with time.perf_counter after a compile-only warm-up
(ModelRunner.compile_prefill of every program experiments.ttft.plan lists), so no compile is
timed (the study counts XLA's compiles while timing: 0). Every mode of a length and the
baselines of its split are compiled first, then timed interleaved: each repetition runs
each of them once (reference first), so a slow spell of the machine falls on all of them
alike; ratios and the split use each one's fastest run (the min), the median is reported
beside it. Each timed prefill also returns the logits of the last fidelity positions and the
last chunk's selections and indexer inputs (a few hundred KB next to the pass), which the
fidelity figures are computed from: what is timed is the pass that is compared.

The split, measured rather than modelled, from TTFT differences of the same model (mins of
the interleaved runs; the baselines measured once per length):
- indexer = TTFT - TTFT with indexer="window" (each query reads the top_k tokens before it:
  the same sparse attention, projections and caches, no selection scoring);
- attention = TTFT with indexer="window" - TTFT with indexer="window" and top_k = 1 (dense
  modes: TTFT - the top_k = 1 baseline);
- other (projections, MLP, norms, cache writes, block summaries, logits, the one-token
  attention) = TTFT of the top_k = 1 baseline.
Steps timed alone would not do: on this kind of machine a lone call pays page faults on its
fresh output buffers that the pass, reusing them, does not.
"""

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.evaluation.metrics import selections_on_captured
from experiments.ttft import plan
from indexer import iou, recall
from indexer.config import hierarchical_plan
from model.buckets import length_bucket
from model.cache import part_copy


@dataclasses.dataclass
class ModeRun:
    """What measuring one mode at one length leaves: its results row, the log-probs of
    the last fidelity positions, (sparse modes) the last positions' captured selections
    and indexer inputs, (the reference) a copy of its pass's indexer keys, for
    comparisons, and its decode steps' times."""

    row: dict | None
    tail_logprobs: np.ndarray | None = None
    captured: dict | None = None
    cache: list | None = None
    decode_ms: dict | None = None


@jax.jit
def _last_row(logits):
    return logits[-1]


class TimedPrefill:
    """The prefill `prefill` (a plan.Prefill) of `tokens` by `runner`, compiled at
    construction (compile_prefill) and timed one call at a time (`time_once`), so that
    several can be interleaved. Each call prefills a fresh cache, allocated before the
    clock starts (as a server's is, ahead of its requests). `times`: TTFT ms of each timed
    call; `out`: the last call's output, when keep_output."""

    def __init__(self, runner, tokens, prefill, *, keep_output=True):
        self.runner, self.tokens, self.prefill = runner, tokens, prefill
        self.keep_output = keep_output
        self.programs = runner.compile_prefill(len(tokens), **prefill.kwargs())
        # The cache's fill programs and the first token's row compile here, not while timed.
        jax.block_until_ready(runner.new_cache(prefill.capacity, exact=True))
        if prefill.logits_from is not None:
            # Run on a stand-in placed as the prefill's logits are, not compiled ahead: see
            # ModelRunner.compile_prefill.
            for stand_in in runner.stand_ins((len(tokens) - prefill.logits_from,
                                              runner.config.vocab_size), jnp.float32):
                jax.block_until_ready(_last_row(stand_in))
        self.times, self.out = [], None

    def time_once(self):
        self.out = None  # the previous pass's cache is freed before the next one
        cache = jax.block_until_ready(self.runner.new_cache(self.prefill.capacity, exact=True))
        t0 = time.perf_counter()
        out = self.runner.prefill(self.tokens, cache=cache, **self.prefill.kwargs())
        last = _last_row(out[0]) if self.prefill.logits_from is not None else out[0]
        int(np.argmax(np.asarray(last)))
        self.times.append(1000 * (time.perf_counter() - t0))
        self.out = out if self.keep_output else None

    def stats(self):
        return {"median": statistics.median(self.times), "min": min(self.times),
                "max": max(self.times), "runs": list(self.times)}


def time_interleaved(timers, repetitions, after_last=None):
    """`repetitions` rounds, each timing every TimedPrefill of `timers` once, in order;
    after_last(timer) right after each one's last call (while its output is the only
    one held: the study takes what it keeps and frees the cache before the next call)."""
    for rep in range(repetitions):
        for timer in timers:
            timer.time_once()
            if after_last is not None and rep == repetitions - 1:
                after_last(timer)


def harvest(spec, timer, run, *, keep_index=False, decode=True):
    """What a mode keeps of its last pass (`timer.out`, then freed) -> ModeRun without its
    row: the fidelity positions' log-probs, the captured selections and indexer inputs
    (sparse modes), a copy of the pass's indexer keys (keep_index: the reference's, which
    the other modes' selections are compared on), and `run.decode_steps` greedy decode
    steps timed after the prompt (decode; the first untimed: it loads or compiles their program)."""
    out, runner, L = timer.out, timer.runner, len(timer.tokens)
    tail_logprobs = np.asarray(jax.nn.log_softmax(out[0], axis=-1))
    cache, captured = out[1], (out[2] if spec.sparse else None)
    # The comparisons read the keys as the prefill left them (decode appends to the cache).
    index_copy = part_copy(cache, "index") if keep_index else None
    timer.out = out = None
    decode_ms = None
    if decode and run.decode_steps:
        token, position, times = int(np.argmax(tail_logprobs[-1])), L, []
        for step in range(run.decode_steps + 1):
            t0 = time.perf_counter()
            logits, cache = runner.decode(token, cache, position)
            token = int(np.argmax(np.asarray(logits)))
            if step:
                times.append(1000 * (time.perf_counter() - t0))
            position += 1
        decode_ms = {"median": statistics.median(times), "min": min(times), "max": max(times)}
    return ModeRun(None, tail_logprobs, captured, index_copy, decode_ms)


def untimed_row(spec, config, L):
    """The row of a mode run once for its fidelity only (ModeSpec.time_max_length); a timed
    mode's row (mode_row) is this one with its timings filled in."""
    return {"context_len": L, "mode": spec.name, "attention": spec.attention,
            "indexer": spec.indexer if spec.sparse else None, "timed": False,
            "ttft_ms": None, "indexer_ms": None, "attention_ms": None, "other_ms": None,
            "indexer_share": None, "baselines_ms": None, "decode_step_ms": None,
            "recall": None, "iou": None, "top1_agreement": None, "logit_kl": None,
            "top1_agreement_vs_dense": None, "logit_kl_vs_dense": None,
            "config": _row_config(config)}


def _row_config(config):
    return {"top_k": config.top_k, "indexer": config.indexer,
            "flat_index_layers": list(config.flat_index_layers),
            "hierarchical": config.hierarchical.to_dict()}


def mode_row(spec, config, timer, mode_run, baselines):
    """The results row of a timed mode: TTFT (its runs' min, median, max), the split from
    the mins of its runs and of `baselines` ({(top_k, prefill_chunk): TimedPrefill}; empty:
    no split, its figures None) and its decode steps (mode_run, from harvest)."""
    ttft, L = timer.stats(), len(timer.tokens)
    row = {**untimed_row(spec, config, L), "timed": True, "ttft_ms": ttft,
           "decode_step_ms": mode_run.decode_ms}
    if not baselines:  # the run times no split (RunConfig.split false)
        return row
    keys = plan.baseline_keys(config, spec.sparse)
    other_ms = min(baselines[keys[-1]].times)
    window_ms = min(baselines[keys[0]].times) if spec.sparse else ttft["min"]
    indexer_ms = ttft["min"] - window_ms
    return {**row, "indexer_ms": indexer_ms, "attention_ms": window_ms - other_ms,
            "other_ms": other_ms, "indexer_share": indexer_ms / ttft["min"],
            "baselines_ms": {"window_top_k": window_ms if spec.sparse else None,
                             "window_top_1": other_ms}}


def perplexity(tail_logprobs, tokens):
    """exp(mean next-token NLL) over the fidelity positions: row j of `tail_logprobs` (the
    last P positions' log-probs) predicts tokens[len - P + j + 1]; the last row predicts
    past the text and is not counted."""
    P, L = len(tail_logprobs), len(tokens)
    targets = np.asarray(tokens[L - P + 1:])
    nll = -tail_logprobs[np.arange(P - 1), targets]
    return float(np.exp(np.mean(nll)))


def scored_share(config, length, positions):
    """The share of the visible keys the hierarchical stage scores exactly per query (its
    candidate blocks over the blocks it can see: indexer.config.hierarchical_plan's budget
    at the pass's key length), mean over the last `positions` queries and the hierarchical
    layers; None when no layer selects hierarchically. DeepSeek-V4: its CSA layers, whose
    keys are compressed entries (one per csa_ratio positions, visible once complete)."""
    if config.v4 is not None:
        ratio = config.v4.csa_ratio
        layers = ([i for i, kind in enumerate(config.v4.layer_types) if kind == "csa"]
                  if config.indexer == "hierarchical" else [])
    else:
        ratio = 1
        layers = [i for i in range(config.n_layers)
                  if config.layer_is_sparse(i) and not config.layer_is_shared(i)
                  and config.layer_indexer(i) == "hierarchical"]
    if not layers:
        return None
    kv_len = length_bucket(length) // ratio
    pos = np.arange(length - positions, length)
    shares = []
    for i in layers:
        h = config.layer_settings(i)
        plan_ = hierarchical_plan(h, positions, kv_len, config.top_k, config.index_heads)
        visible = np.maximum(((pos + 1) // ratio - 1) // h.block_size + 1, 1)
        shares.append(np.mean(np.minimum(visible, plan_.n_cand) / visible))
    return float(np.mean(shares))


def selection_overlap(config, reference, length, own):
    """Recall and IoU (means over layers and the last P queries) of `config`'s selection
    against the reference mode's, both on the reference pass's captured indexer inputs.
    DeepSeek-V4, whose CSA indexer scores compressed entries (its inputs are not captured):
    the entries each mode's own pass selected (`own`: this mode's ModeRun), over the CSA
    layers; the passes' hidden states differ by what earlier layers selected, so this
    counts that drift too."""
    if config.v4 is not None:
        csa = [i for i, kind in enumerate(config.v4.layer_types) if kind == "csa"]
        pairs = [(own.captured["indices"][i], reference.captured["indices"][i]) for i in csa]
        return (float(np.mean([recall(s, r) for s, r in pairs])),
                float(np.mean([iou(s, r) for s, r in pairs])))
    P = reference.captured["indices"].shape[1]
    other = selections_on_captured(config, reference.captured, reference.cache, length - P,
                                   length)
    ref = reference.captured["indices"]
    return (float(np.mean([recall(other[i], ref[i]) for i in range(len(ref))])),
            float(np.mean([iou(other[i], ref[i]) for i in range(len(ref))])))
