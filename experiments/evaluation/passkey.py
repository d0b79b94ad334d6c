"""Passkey retrieval probe for pretrained (BPE) models: can each method find a number said
once, far back in the context?

A sequence of L tokens is held-out text with `per_sequence` sentences "The pass key of
NAME is DDDDD." spliced in at depths spread over the context; it ends with the same
sentences for every NAME, in another order. A probe is correct when, teacher forced, the
model's greedy choice at each of the key's digit positions (digits are single tokens in
SmolLM2's tokenizer) in the final block is the right digit; the key appears nowhere else.
One prefill per sequence scores all its probes. Accuracy comes with a Wilson 95% interval
(probes in one sequence share a context, so the interval is a little optimistic).
"""

import dataclasses
import math

import numpy as np

NAMES = ("Alice", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ingrid",
         "Jonas", "Keiko", "Liam", "Maya", "Nikos", "Olga", "Pedro", "Quinn", "Rosa", "Sven",
         "Tara", "Umar", "Vera", "Wen", "Ximena", "Yusuf", "Zoe")


@dataclasses.dataclass
class PasskeySequence:
    tokens: np.ndarray  # int32[L]
    answer_positions: list  # per probe: positions whose next token is a key digit
    answer_tokens: list  # per probe: the digit tokens
    depths: list  # per probe: where its key sentence starts, as a fraction of L
    query_start: int  # first position of the final block


def wilson_interval(successes, n, z=1.96):
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def build_passkey_sequence(tokenizer, filler, length, *, per_sequence, seed):
    """filler: int tokens of held-out text (at least `length`). -> PasskeySequence."""
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
    order = rng.permutation(per_sequence)
    final = [tok for i in order for tok in head[i] + tail[i]]
    body_len = length - len(final)
    inserted = sum(len(h) + len(t) for h, t in zip(head, tail))
    n_filler = body_len - inserted
    if n_filler < per_sequence * 8:
        raise ValueError(f"length {length} is too short for {per_sequence} passkeys")
    offset = int(rng.integers(0, max(1, len(filler) - n_filler)))
    text = list(np.asarray(filler[offset:offset + n_filler]))
    # depths: evenly spread over 5%..90% of the filler, jittered, kept in order
    cuts = np.sort((np.linspace(0.05, 0.9, per_sequence) +
                    rng.uniform(-0.02, 0.02, per_sequence)).clip(0.0, 1.0) * n_filler
                   ).astype(int)
    body, starts, prev = [], {}, 0
    for slot, cut in enumerate(cuts):
        body += text[prev:cut]
        starts[slot] = len(body)
        body += head[slot] + tail[slot]
        prev = cut
    body += text[prev:]
    tokens = np.asarray(body + final, np.int32)
    assert len(tokens) == length
    answer_positions, answer_tokens, depths = [], [], []
    pos = len(body)
    first_digit = {}
    for i in order:
        first_digit[i] = pos + len(head[i]) + 1  # after the space token
        pos += len(head[i]) + len(tail[i])
    for slot in range(per_sequence):
        p0 = first_digit[slot]
        answer_positions.append([p0 + j - 1 for j in range(5)])  # the logits that predict them
        answer_tokens.append(digits[slot])
        depths.append(starts[slot] / length)
    return PasskeySequence(tokens, answer_positions, answer_tokens, depths, len(body))


def score_passkeys(logits_tail, seq):
    """logits_tail: f32[L - query_start, V] for positions query_start.. -> bool per probe."""
    pred = np.asarray(logits_tail).argmax(-1)
    return [all(pred[p - seq.query_start] == t for p, t in zip(ps, ts))
            for ps, ts in zip(seq.answer_positions, seq.answer_tokens)]
