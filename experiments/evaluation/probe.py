"""Retrieval probe of the long-context evaluation: defined early, needed late.

A few `NAME = "word_word"` lines are spliced into the held-out text near its start. After
the context (its first L - PROBE_RESERVE tokens) the model reads `\\nNAME = "` and, teacher
forced, each candidate value: the secret assigned to NAME and `n_distractors` secrets of
the same form that occur nowhere in the sequence.

Each candidate is scored in bits per character (its closing quote included, so it is a
complete value; per character, so length does not decide) twice: after the long context
and with no context at all. Its lift is the difference (bits per character the context
saves); comparing lifts, not raw scores, takes out the model's prior for the words.

- accuracy: share of probes whose secret has a strictly larger lift than every distractor;
  chance is 1 / (1 + n_distractors);
- gain (bits per character): the secret's lift minus the distractors' mean lift; ~0 for a
  model that ignores the definition, positive when it copies it;
- exact: greedy continuation equals the secret (the strictest form; rare for small models).

Secrets are two words from a fixed list (not random characters): a small byte-level model
copies word-like identifiers over short ranges, random strings hardly at all, so the probe
can tell a model that retrieves from one that does not (calibrate with short lengths, where
the definition lies a few hundred tokens back).
"""

import numpy as np

from experiments.data import eval_sequence
from model.tokenizer import decode, encode

PROBE_NAMES = ("SECRET_KEY", "API_TOKEN", "SESSION_ID", "BUILD_TAG", "CACHE_DIR",
               "USER_NAME", "HOST_LABEL", "QUEUE_NAME")
PROBE_RESERVE = 64
TIE_BITS = 1e-6  # bits per character closer than this are a tie (float rounding), not a win
WORDS = ("apple", "river", "stone", "cloud", "paper", "window", "garden", "silver", "orange",
         "bridge", "candle", "forest", "rocket", "pencil", "marble", "tiger", "violet", "anchor",
         "copper", "meadow", "falcon", "lemon", "harbor", "velvet", "canyon", "pepper",
         "island", "summit", "walnut", "comet", "saddle", "tunnel")


def word_secret(rng):
    """`word_word`, both words drawn from WORDS."""
    return "_".join(rng.choice(WORDS, size=2))


def build_sequence(heldout_tokens, length, *, seed, n_probes):
    """-> (tokens int32[length], byte-target mask bool[length], probes [(name, secret)]).

    Held-out text from the stream's start, with `NAME = "secret"` lines spliced in at the
    first line break after token 64 (at most a quarter into the context); mask is False on
    the spliced bytes and on BOS/EOS. No probes when they would not fit."""
    rng = np.random.default_rng([seed, length])
    secrets = []
    while len(secrets) < n_probes:  # distinct secrets: a distractor never equals one
        s = word_secret(rng)
        if s not in secrets:
            secrets.append(s)
    probes = list(zip(PROBE_NAMES[:n_probes], secrets))
    insert = "".join(f'{name} = "{secret}"\n' for name, secret in probes)
    insert_ids = np.asarray(encode(insert, bos=False), np.int32)
    if len(insert_ids) + 16 > length - PROBE_RESERVE:
        insert_ids, probes = insert_ids[:0], []
    base = eval_sequence(heldout_tokens, length - len(insert_ids))
    newlines = np.nonzero(base[64:] == ord("\n"))[0]
    at = 64 + int(newlines[0]) + 1 if newlines.size else 64
    at = min(at, max(1, (length - PROBE_RESERVE) // 4))
    tokens = np.concatenate([base[:at], insert_ids, base[at:]]).astype(np.int32)
    mask = (tokens < 256)
    mask[at:at + len(insert_ids)] = False
    return tokens, mask, probes


def distractors(tokens, probes, n, *, seed):
    """n secrets per probe, of the probes' form but made of words no probe's secret uses (a
    model that copies any word of the definitions still ranks the secret first), none
    occurring in `tokens` -> list (per probe) of lists of str."""
    text = decode(tokens)
    used = {w for _, s in probes for w in s.split("_")}
    free = [w for w in WORDS if w not in used]
    # Half the word pairs at most: room for the ones rejected because the text holds them.
    most = len(free) ** 2 // 2 // max(len(probes), 1)
    if not 1 <= n <= most:
        raise ValueError(f"n (distractors per probe) must be in [1, {most}] for "
                         f"{len(probes)} probes ({len(free)} unused words), got {n}")
    rng = np.random.default_rng([seed, len(tokens), 7])
    taken, out = set(), []
    for _ in probes:
        mine = []
        while len(mine) < n:
            s = "_".join(rng.choice(free, size=2))
            if s not in taken and s not in text:
                taken.add(s)
                mine.append(s)
        out.append(mine)
    return out


def _ids(text):
    return np.asarray(encode(text, bos=False), np.int32)


def candidate_nll(score, name, candidate):
    """Bits per character of `candidate` and its closing quote after `\\nNAME = "`, teacher
    forced.
    score(ids int32[N]) -> log-probs f32[N, V] of the tokens after each of ids."""
    prompt = _ids(f'\n{name} = "')
    value = _ids(candidate + '"')
    lp = score(np.concatenate([prompt, value]))
    pred = lp[len(prompt) - 1:len(prompt) - 1 + len(value)]
    return float(-pred[np.arange(len(value)), value].sum() / np.log(2) / len(value))


def run_probe(score, prior, greedy, probes, distractor_sets):
    """score: as in candidate_nll, after the long context; prior: the same right after BOS,
    with no context (the model's own preference among candidates, which the context must
    overcome);
    greedy(prompt ids, n) -> n greedily decoded ids.
    -> {"accuracy", "gain_bits_per_char", "exact", "chance", "probes": [...]}."""
    def lift(name, candidate):  # bits per char the context saves on this candidate
        return candidate_nll(prior, name, candidate) - candidate_nll(score, name, candidate)

    rows = []
    for (name, secret), others in zip(probes, distractor_sets):
        own = lift(name, secret)
        rest = [lift(name, d) for d in others]
        got = decode(greedy(_ids(f'\n{name} = "'), len(secret)))
        rows.append({"name": name, "secret": secret, "secret_lift": round(own, 4),
                     "distractor_lift": round(float(np.mean(rest)), 4),
                     "ranked_first": bool(own > max(rest) + TIE_BITS), "greedy": got,
                     "exact": got == secret})
    if not rows:
        return None
    return {"accuracy": float(np.mean([r["ranked_first"] for r in rows])),
            "gain_bits_per_char": round(float(np.mean(
                [r["secret_lift"] - r["distractor_lift"] for r in rows])), 4),
            "exact": float(np.mean([r["exact"] for r in rows])),
            "chance": round(1.0 / (1 + len(distractor_sets[0])), 4), "probes": rows}
