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


@dataclasses.dataclass
class ModeRun:
    """What measuring one mode at one length leaves: its results row, the log-probs of
    the last fidelity positions, and (sparse modes) the last positions' captured
    selections and indexer inputs with the pass's cache, for comparisons."""

    row: dict
    tail_logprobs: np.ndarray | None = None
    captured: dict | None = None
    cache: list | None = None


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
        jax.block_until_ready(runner.new_cache(prefill.capacity))
        if prefill.logits_from is not None:
            rows = len(tokens) - prefill.logits_from
            placed = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if runner.mesh is None
                      else jax.sharding.NamedSharding(runner.mesh, jax.sharding.PartitionSpec()))
            _last_row.lower(jax.ShapeDtypeStruct((rows, runner.config.vocab_size), jnp.float32,
                                                 sharding=placed)).compile()
        self.times, self.out = [], None

    def time_once(self):
        self.out = None  # the previous pass's cache is freed before the next one
        cache = jax.block_until_ready(self.runner.new_cache(self.prefill.capacity))
        t0 = time.perf_counter()
        out = self.runner.prefill(self.tokens, cache=cache, **self.prefill.kwargs())
        last = _last_row(out[0]) if self.prefill.logits_from is not None else out[0]
        int(np.argmax(np.asarray(last)))
        self.times.append(1000 * (time.perf_counter() - t0))
        self.out = out if self.keep_output else None

    def stats(self):
        return {"median": statistics.median(self.times), "min": min(self.times),
                "max": max(self.times), "runs": list(self.times)}


def time_interleaved(timers, repetitions):
    """`repetitions` rounds, each timing every TimedPrefill of `timers` once, in order."""
    for _ in range(repetitions):
        for timer in timers:
            timer.time_once()


def finish_mode(spec, config, timer, run, baselines, *, keep_cache=False):
    """The ModeRun of a mode timed by `timer` (after time_interleaved): decode steps after
    its last prefill, the split from the mins of its runs and of `baselines` ({(top_k,
    prefill_chunk): TimedPrefill}). keep_cache: keep the prefill's cache in the ModeRun
    (the reference's: the other modes' selections are compared on its inputs)."""
    out, runner, L = timer.out, timer.runner, len(timer.tokens)
    ttft = timer.stats()
    tail_logprobs = np.asarray(jax.nn.log_softmax(out[0], axis=-1))
    cache, captured = out[1], (out[2] if spec.sparse else None)
    # The comparisons read the cache as the prefill left it (decode appends to it).
    prefill_cache = jax.tree.map(jnp.copy, cache) if keep_cache else None
    timer.out = None

    decode_ms = None
    if run.decode_steps:  # greedy steps after the prompt (compiled before; one untimed)
        token, position, times = int(np.argmax(tail_logprobs[-1])), L, []
        for step in range(run.decode_steps + 1):
            t0 = time.perf_counter()
            logits, cache = runner.decode(token, cache, position)
            token = int(np.argmax(np.asarray(logits)))
            if step:
                times.append(1000 * (time.perf_counter() - t0))
            position += 1
        decode_ms = {"median": statistics.median(times), "min": min(times), "max": max(times)}

    keys = plan.baseline_keys(config, spec.sparse)
    other_ms = min(baselines[keys[-1]].times)
    window_ms = min(baselines[keys[0]].times) if spec.sparse else ttft["min"]
    indexer_ms = ttft["min"] - window_ms
    row = {"context_len": L, "mode": spec.name, "attention": spec.attention,
           "indexer": spec.indexer if spec.sparse else None,
           "ttft_ms": ttft, "indexer_ms": indexer_ms, "attention_ms": window_ms - other_ms,
           "other_ms": other_ms, "indexer_share": indexer_ms / ttft["min"],
           "baselines_ms": {"window_top_k": window_ms if spec.sparse else None,
                            "window_top_1": other_ms},
           "decode_step_ms": decode_ms, "recall": None, "iou": None,
           "top1_agreement": None, "logit_kl": None,
           "top1_agreement_vs_dense": None, "logit_kl_vs_dense": None,
           "config": {"top_k": config.top_k, "indexer": config.indexer,
                      "flat_index_layers": list(config.flat_index_layers),
                      "hierarchical": config.hierarchical.to_dict()}}
    return ModeRun(row, tail_logprobs, captured, prefill_cache)


def selection_overlap(config, reference, length):
    """Recall and IoU (means over layers and the last P queries) of `config`'s selection
    against the reference mode's, both on the reference pass's captured indexer inputs."""
    P = reference.captured["indices"].shape[1]
    other = selections_on_captured(config, reference.captured, reference.cache, length - P,
                                   length)
    ref = reference.captured["indices"]
    return (float(np.mean([recall(other[i], ref[i]) for i in range(len(ref))])),
            float(np.mean([iou(other[i], ref[i]) for i in range(len(ref))])))
