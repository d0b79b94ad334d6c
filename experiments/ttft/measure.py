"""Measuring one mode at one context length: TTFT, its split, decode steps, fidelity.

TTFT is prefill start to first token available (the last position's logits ready and
argmax'd on the host), timed with time.perf_counter over `repetitions` prefills after a
compile-only warm-up (ModelRunner.compile_prefill), so no compile is timed. Each timed
prefill also returns the logits of the last fidelity positions and the last chunk's
selections and indexer inputs (a few hundred KB next to the pass), which the fidelity
figures are computed from: what is timed is the pass that is compared.

The split, measured rather than modelled, from TTFT differences of the same model (each a
median of timed prefills, the baselines measured once per length):
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
from indexer import iou, recall
from model import ModelRunner, with_config


@dataclasses.dataclass
class ModeRun:
    """What measuring one mode at one length leaves: its results row, the log-probs of
    the last fidelity positions, and (sparse modes) the last positions' captured
    selections and indexer inputs with the pass's cache, for comparisons."""

    row: dict
    tail_logprobs: np.ndarray | None = None
    captured: dict | None = None
    cache: list | None = None


def timed_prefills(runner, tokens, *, capacity, repetitions, logits_from=None, capture=(),
                   capture_from=None):
    """`repetitions` prefills after a compile-only warm-up -> (TTFT ms list, the last
    prefill's output)."""
    args = dict(capacity=capacity, logits_from=logits_from, capture=capture,
                capture_from=capture_from)
    runner.compile_prefill(len(tokens), **args)
    times, out = [], None
    for _ in range(repetitions):
        out = None  # the previous pass's cache is freed before the next one
        t0 = time.perf_counter()
        out = runner.prefill(tokens, **args)
        last = out[0][-1] if logits_from is not None else out[0]
        int(np.argmax(np.asarray(last)))
        times.append(1000 * (time.perf_counter() - t0))
    return times, out


def baseline_ttft_ms(model, config, tokens, run, *, top_k):
    """Median TTFT of `config` with indexer="window" reading `top_k` tokens per query (the
    selection-free baselines of the split)."""
    window = config.replace(attention="sparse", indexer="window", flat_index_layers=(),
                            top_k=top_k)
    runner = ModelRunner(with_config(model, window))
    times, _ = timed_prefills(runner, tokens, capacity=len(tokens) + run.decode_steps + 1,
                              repetitions=run.repetitions)
    return statistics.median(times)


def measure_mode(model, spec, tokens, run, *, baseline_ms, keep_cache=False):
    """Measures `spec` (a ModeSpec) on `tokens` -> ModeRun. run: the RunConfig.
    baseline_ms(config, top_k) -> the window baseline's TTFT at this length. keep_cache:
    keep the prefill's cache in the ModeRun (the reference's: the other modes' selections
    are compared on its inputs)."""
    config = spec.model_config(model.config)
    runner = ModelRunner(with_config(model, config))
    L, P = len(tokens), run.fidelity_positions
    capacity = L + run.decode_steps + 1
    capture = ("indexer", "indices") if spec.sparse else ()
    ttfts, out = timed_prefills(runner, tokens, capacity=capacity,
                                repetitions=run.repetitions, logits_from=L - P,
                                capture=capture, capture_from=L - P)
    ttft = statistics.median(ttfts)
    tail_logprobs = np.asarray(jax.nn.log_softmax(out[0], axis=-1))
    cache, captured = out[1], (out[2] if capture else None)
    # The comparisons read the cache as the prefill left it (decode appends to it).
    prefill_cache = jax.tree.map(jnp.copy, cache) if keep_cache else None

    decode_ms = None
    if run.decode_steps:  # greedy steps after the prompt; one untimed step compiles
        token, position, times = int(np.argmax(tail_logprobs[-1])), L, []
        for step in range(run.decode_steps + 1):
            t0 = time.perf_counter()
            logits, cache = runner.decode(token, cache, position)
            token = int(np.argmax(np.asarray(logits)))
            if step:
                times.append(1000 * (time.perf_counter() - t0))
            position += 1
        decode_ms = {"median": statistics.median(times), "min": min(times), "max": max(times)}

    other_ms = baseline_ms(config, 1)
    window_ms = baseline_ms(config, config.top_k) if spec.sparse else ttft
    indexer_ms = ttft - window_ms
    row = {"context_len": L, "mode": spec.name, "attention": spec.attention,
           "indexer": spec.indexer if spec.sparse else None,
           "ttft_ms": {"median": ttft, "min": min(ttfts), "max": max(ttfts), "runs": ttfts},
           "indexer_ms": indexer_ms, "attention_ms": window_ms - other_ms,
           "other_ms": other_ms, "indexer_share": indexer_ms / ttft,
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
