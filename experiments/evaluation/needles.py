"""Needle sweep: one key-value sentence ("The pass key of NAME is DDDDD.") at a chosen depth
of held-out text, asked about at the end.

Each context is prefilled once per method; every question then extends a copy of that
cached prefix (ModelRunner.prefill(cache=, start=)), so a context costs one long prefill
however many questions it serves. Two questions per context (QUESTIONS: the sentence's
own opening, and a question-and-answer form), each scored two ways: teacher forced (the
share of the answer's tokens that are the greedy choice given the right ones before) and
generated (greedy decoding of as many tokens as the answer has, matched exactly).

Context i of a sweep has seed seed * 1000 + L + i, its depth DEPTHS[i % len(depths)]: the
first n contexts are the same in every run (what lets baselines be computed once).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments.evaluation.retrieval import NAMES

DEPTHS = (0.05, 0.275, 0.5, 0.725, 0.95)
QUESTIONS = ("\nThe pass key of {name} is",
             "\nQuestion: what is the pass key of {name}? Answer: The pass key of {name} is")


@dataclasses.dataclass
class NeedleContext:
    tokens: np.ndarray  # int32[n]: held-out text with the needle spliced in
    depth: float  # the depth asked for (contexts are grouped by it)
    answer: list  # the key's tokens (" DDDDD")
    questions: list  # token lists, each followed by the answer
    placed: float = None  # the share of the context's filler text really before the needle


def build_needle_context(tokenizer, filler, length, depth, *, seed):
    """A context of `length` tokens minus room for the longest question and the answer,
    the needle at `depth` (0..1) of it -> NeedleContext."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    rng = np.random.default_rng(seed)
    name, key = str(rng.choice(NAMES)), int(rng.integers(10000, 100000))
    needle = list(tokenizer.encode(f"\nThe pass key of {name} is {key}.\n", bos=False))
    answer = list(tokenizer.encode(f" {key}", bos=False))
    questions = [list(tokenizer.encode(q.format(name=name), bos=False)) for q in QUESTIONS]
    n_filler = length - max(map(len, questions)) - len(answer) - len(needle)
    if n_filler < 16:
        raise ValueError(f"length {length} is too short for a needle and its questions")
    filler = np.asarray(filler)
    if len(filler) < n_filler:
        raise ValueError(f"the filler text has {len(filler)} tokens; the needle sweep at "
                         f"length {length} needs {n_filler}")
    offset = int(rng.integers(0, len(filler) - n_filler + 1))
    text = filler[offset:offset + n_filler].tolist()
    cut = int(round(depth * n_filler))
    tokens = np.asarray(text[:cut] + needle + text[cut:], np.int32)
    return NeedleContext(tokens, depth, answer, questions, placed=cut / n_filler)


def score_context(runner, ctx, capacity):
    """One prefill of the context, then each question from a copy of its cache -> a list
    of [teacher-forced share right, 1.0 if generated exactly else 0.0], one per question."""
    _, cache = runner.prefill(ctx.tokens, capacity=capacity)
    start, answer = len(ctx.tokens), ctx.answer
    out = []
    for q in ctx.questions:
        forced = np.asarray(q + answer[:-1], np.int32)
        logits, _ = runner.prefill(forced, cache=jax.tree.map(jnp.copy, cache), start=start,
                                   logits_from=start + len(q) - 1)
        teacher = float(np.mean(np.asarray(logits).argmax(-1) == np.asarray(answer)))
        generated = list(runner.generate(q, len(answer), cache=jax.tree.map(jnp.copy, cache),
                                         start=start))
        out.append([teacher, float(generated == answer)])
    return out


def needle_contexts(tokenizer, filler, length, n, seed, depths=DEPTHS):
    return [build_needle_context(tokenizer, filler, length, depths[i % len(depths)],
                                 seed=seed * 1000 + length + i) for i in range(n)]


def summarize(scores, contexts, per_context):
    """scores: [teacher, exact] per (context, question) -> overall and per-depth means."""
    scores = np.asarray(scores, np.float64).reshape(len(contexts), per_context, 2)
    by_depth = {}
    for ctx, s in zip(contexts, scores):
        by_depth.setdefault(round(ctx.depth, 3), []).append(s)
    return dict(teacher_forced=round(float(scores[..., 0].mean()), 4),
                generated_exact=round(float(scores[..., 1].mean()), 4),
                by_depth={str(d): dict(teacher_forced=round(float(np.mean([x[:, 0] for x in v])),
                                                            4),
                                       generated_exact=round(float(np.mean([x[:, 1] for x in v])),
                                                             4), contexts=len(v))
                          for d, v in sorted(by_depth.items())})


def contexts_below(scores, reference, per_context):
    """The contexts a method answers worse than the reference (dense) on the same contexts,
    each context scored by the mean of its questions' teacher-forced shares -> (count of
    contexts below, contexts). scores / reference: [teacher, exact] per (context, question)."""
    ours = np.asarray(scores, np.float64)[:, 0].reshape(-1, per_context).mean(1)
    theirs = np.asarray(reference, np.float64)[:, 0].reshape(-1, per_context).mean(1)
    if ours.shape != theirs.shape:
        raise ValueError(f"contexts_below: {len(ours)} contexts against {len(theirs)}")
    return int(np.sum(ours < theirs - 1e-9)), len(ours)
