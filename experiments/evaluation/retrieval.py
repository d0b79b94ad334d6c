"""Retrieval probes for pretrained (BPE) models: can each method find what was said once,
far back in the context? Three kinds, one scoring rule.

copy (the default): `per_sequence` strings of random words (STRING_TOKENS one-token
lowercase words drawn from the filler text's own vocabulary, or any of its tokens when the
vocabulary has too few whole words; each string preceded by a newline) are spliced into held-out
text at depths spread over the context; the sequence ends with every string again, in
another order. The first CUE_TOKENS of a string are its cue; a probe is correct when,
teacher forced, the model's greedy choice at each of the remaining positions is the string's
next token. Only the string itself says what comes next (induction), so a method that drops
its tokens cannot get it right by chance.

copy_rare: the same, with words that never occur in the filler text (one-token words of the
tokenizer's whole vocabulary). A rare token is easy to find wherever it is; a word the text
uses everywhere can only be found through the list around it (what an induction head
matches on). The two kinds tell an indexer that finds content from one that keeps context.

passkey: a sequence of L tokens is held-out text with `per_sequence` sentences "The pass key of
NAME is DDDDD." spliced in at depths spread over the context; it ends with the same
sentences for every NAME, in another order. A probe is correct when, teacher forced, the
model's greedy choice at each of the key's digit positions (digits are single tokens in
SmolLM2's tokenizer) in the final block is the right digit; the key appears nowhere else.
One prefill per sequence scores all its probes. Two accuracies: exact (every answer token
right; Wilson 95% interval over probes, a little optimistic since probes in one sequence
share a context) and per token (the share of answer tokens right; its interval, and that
of a method's difference to dense on the same sequences, are over sequences).
"""

import dataclasses
import functools
import math
import re

import numpy as np

KINDS = ("copy", "copy_rare", "passkey")
STRING_TOKENS, CUE_TOKENS = 16, 4

NAMES = ("Alice", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ingrid",
         "Jonas", "Keiko", "Liam", "Maya", "Nikos", "Olga", "Pedro", "Quinn", "Rosa", "Sven",
         "Tara", "Umar", "Vera", "Wen", "Ximena", "Yusuf", "Zoe")


@dataclasses.dataclass
class ProbeSequence:
    tokens: np.ndarray  # int32[L]
    answer_positions: list  # per probe: positions whose next token is an answer token
    answer_tokens: list  # per probe: the answer tokens (key digits; a string's continuation)
    depths: list  # per probe: where its first mention starts, as a fraction of L
    query_start: int  # first position of the final block


def wilson_interval(successes, n, z=1.96):
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def build_probe_sequence(kind, tokenizer, filler, length, *, per_sequence, seed):
    """kind: one of KINDS -> ProbeSequence."""
    if kind not in KINDS:
        raise ValueError(f"probe kind must be one of {KINDS}, got {kind!r}")
    if kind == "passkey":
        return build_passkey_sequence(tokenizer, filler, length, per_sequence=per_sequence,
                                      seed=seed)
    return build_copy_sequence(tokenizer, filler, length, per_sequence=per_sequence,
                               seed=seed, rare=kind == "copy_rare")


def _splice(filler, inserts, n_filler, rng):
    """Held-out text of n_filler tokens with `inserts` (token lists) spliced in at depths
    evenly spread over 5%..90% of it, jittered, in order -> (body, start of each insert)."""
    offset = int(rng.integers(0, max(1, len(filler) - n_filler)))
    text = list(np.asarray(filler[offset:offset + n_filler]))
    n = len(inserts)
    cuts = np.sort((np.linspace(0.05, 0.9, n) + rng.uniform(-0.02, 0.02, n)).clip(0.0, 1.0)
                   * n_filler).astype(int)
    body, starts, prev = [], [], 0
    for insert, cut in zip(inserts, cuts):
        body += text[prev:cut]
        starts.append(len(body))
        body += insert
        prev = cut
    return body + text[prev:], starts


def _layout(filler, inserts, length, rng, what):
    """The inserts spliced into held-out text, then all asked again at the end in a random
    order -> (tokens i32[length], {insert: position of its first token in the final block},
    query_start, depth of each insert's first mention as a fraction of length)."""
    n_filler = length - 2 * sum(map(len, inserts))
    if n_filler < len(inserts) * 8:
        raise ValueError(f"length {length} is too short for {len(inserts)} {what}")
    body, starts = _splice(filler, inserts, n_filler, rng)
    final_order = rng.permutation(len(inserts))
    tokens = np.asarray(body + [tok for i in final_order for tok in inserts[i]], np.int32)
    if len(tokens) != length:
        raise AssertionError(f"built {len(tokens)} tokens, wanted {length}")
    first, pos = {}, len(body)
    for i in final_order:
        first[i] = pos
        pos += len(inserts[i])
    return tokens, first, len(body), [st / length for st in starts]


def word_tokens(tokenizer, ids):
    """The distinct tokens of `ids` that are one lowercase word after a space (" river"):
    random lists of them read as words, which a model copies by induction, where random
    sub-word pieces mostly defeat a small model even dense."""
    ids = np.unique(np.asarray(ids))
    return np.asarray([t for t in ids if re.fullmatch(r" [a-z]{3,}", tokenizer.decode([int(t)]))],
                      np.int32)


@functools.lru_cache(maxsize=4)
def _vocabulary_words(tokenizer):
    return word_tokens(tokenizer, np.arange(tokenizer.vocab_size))


def rare_word_tokens(tokenizer, filler):
    """One-token words of the tokenizer's vocabulary that never occur in `filler` (any
    non-special token that does not, for a vocabulary without whole-word tokens)."""
    words = _vocabulary_words(tokenizer)
    if len(words) < STRING_TOKENS:
        special = {tokenizer.bos_id, *tokenizer.stop_ids, *tokenizer.encode("\n", bos=False)}
        words = np.asarray([t for t in range(tokenizer.vocab_size) if t not in special
                            and tokenizer.decode([t])], np.int32)
    return np.setdiff1d(words, np.asarray(filler)).astype(np.int32)


def build_copy_sequence(tokenizer, filler, length, *, per_sequence, seed, rare=False):
    """filler: int tokens of held-out text (at least `length`). -> ProbeSequence whose probes
    are random-token strings asked again at the end (see the module docstring); rare: words
    that never occur in the filler (copy_rare)."""
    rng = np.random.default_rng(seed)
    newline = list(tokenizer.encode("\n", bos=False))
    vocab = (rare_word_tokens if rare else word_tokens)(tokenizer, filler)
    if len(vocab) < STRING_TOKENS:  # a vocabulary without whole-word tokens (bytes)
        vocab = np.setdiff1d(np.unique(np.asarray(filler)), newline)
    if len(vocab) < STRING_TOKENS:
        raise ValueError(f"the filler text has {len(vocab)} distinct tokens; the copy probe "
                         f"needs at least {STRING_TOKENS}")
    strings = [[int(t) for t in rng.choice(vocab, size=STRING_TOKENS, replace=False)]
               for _ in range(per_sequence)]
    tokens, first, query_start, depths = _layout(filler, [newline + s for s in strings],
                                                 length, rng, "copy probes")
    # the logits at position p predict token p + 1: string token j sits at first + len(nl) + j
    answer_positions = [[first[i] + len(newline) + j - 1 for j in range(CUE_TOKENS,
                                                                         STRING_TOKENS)]
                        for i in range(per_sequence)]
    answer_tokens = [s[CUE_TOKENS:] for s in strings]
    return ProbeSequence(tokens, answer_positions, answer_tokens, depths, query_start)


def build_passkey_sequence(tokenizer, filler, length, *, per_sequence, seed):
    """filler: int tokens of held-out text (at least `length`). -> ProbeSequence of passkey
    sentences asked again at the end (see the module docstring)."""
    rng = np.random.default_rng(seed)
    names = rng.choice(NAMES, size=per_sequence, replace=False)
    keys = rng.integers(10000, 100000, size=per_sequence)
    head = [tokenizer.encode(f"\nThe pass key of {n} is", bos=False) for n in names]
    tail = [tokenizer.encode(f" {k}.\n", bos=False) for k in keys]
    digits = [[tokenizer.encode(d, bos=False)[0] for d in str(k)] for k in keys]
    for t, d in zip(tail, digits):
        # " 12345.\n" must read as a space, then the digits, one token each
        if t[1:6] != d:
            raise ValueError("the tokenizer does not split digits one by one; the passkey "
                             "probe needs it")
    tokens, first, query_start, depths = _layout(
        filler, [list(h) + list(t) for h, t in zip(head, tail)], length, rng, "passkeys")
    answer_positions = [[first[i] + len(head[i]) + 1 + j - 1 for j in range(5)]  # after " "
                        for i in range(per_sequence)]
    return ProbeSequence(tokens, answer_positions, digits, depths, query_start)


def score_probes(logits_tail, seq):
    """logits_tail: f32[L - query_start, V] for positions query_start.. -> per probe, the
    share of its answer positions where the greedy choice is the answer token (1.0: the
    probe is answered exactly)."""
    pred = np.asarray(logits_tail).argmax(-1)
    return [float(np.mean([pred[p - seq.query_start] == t for p, t in zip(ps, ts)]))
            for ps, ts in zip(seq.answer_positions, seq.answer_tokens)]


def mean_interval(values, z=1.96):
    """Mean of `values` (one per independent unit) with a normal 95% interval."""
    values = np.asarray(values, np.float64)
    mean = float(values.mean())
    half = z * float(values.std(ddof=1)) / np.sqrt(len(values)) if len(values) > 1 else np.inf
    return mean, (mean - half, mean + half)
