"""Configuration of the hierarchical (coarse-to-fine) lightning indexer.

Knob names follow the reference deployment where it has one: `block_size`, the candidate
budget (`candidate_tokens`, or `coarse_keep_ratio`, which the reference calls
COARSE_THRESHOLD), `fine_batch_size` (queries scored per fine step).
"""

import dataclasses
import math
from typing import NamedTuple

HEAD_SELECT_KINDS = ("max_abs_weight", "first")
COARSE_KINDS = ("mean", "learned")
_INT_MAX = 1 << 30
# Fast ranking (HierarchicalConfig.fast_ranking) halves a score window this many times
# (indexer.scoring.threshold_topk): scores closer than (row max - row min) x 2^-20 to
# the k-th may be swapped, finer than packing a column into a score's low bits did (11
# mantissa bits at 4096 columns).
FAST_RANKING_ROUNDS = 20
# Keys scored per step by the streaming flat selection (indexer.streaming). With the xla
# path's 64-query steps, 32768 keys were the fastest tile on the 2-core CPU at 32K-64K
# (top_k 256 and 1024; 8192-key tiles took 1.4-2.7x as long, more merges): the score
# temporaries stay within 64 MiB at any context.
STREAMING_KEY_TILE = 32768


@dataclasses.dataclass(frozen=True)
class Offered:
    """Marks a selection settings field that serving (a config key of the same name in any
    case, and `python -m serving --<name>`) and the CLIs offer.

    name: the switch's name there (None: the field's own; e.g. HierarchicalConfig's
      coarse_keep_ratio is offered as the reference's COARSE_THRESHOLD). clears: fields
      this one replaces (set to None with it: two spellings of one budget; setting both is
      an error). ge, gt, le: the switch's bounds; choices: its allowed values. Serving
      checks the switch alone with them (the settings class checks the whole, at load)."""

    name: str | None = None
    clears: tuple = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple | None = None


def offered(default, **how):
    """A dataclass field of a selection settings class that serving and the CLIs offer
    (Offered's keywords)."""
    return dataclasses.field(default=default, metadata={"offered": Offered(**how)})


class FrozenConfig:
    """Shared behaviour of dosa's frozen, validated config dataclasses: `replace`, a plain
    `to_dict`, and `from_dict`, which rejects unknown keys by name with the allowed ones and
    builds nested config fields (annotated with a FrozenConfig subclass) from dicts."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data):
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} expects a mapping, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; allowed: "
                             f"{sorted(fields)}")
        values = {}
        for name, value in data.items():
            kind = fields[name].type
            if isinstance(kind, type) and issubclass(kind, FrozenConfig) and isinstance(value,
                                                                                       dict):
                value = kind.from_dict(value)
            values[name] = value
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class HierarchicalConfig(FrozenConfig):
    """Knobs of `indexer.hierarchical_topk` (frozen, validated on construction).

    Defaults are the `small` indexer's settings (H_I=4, d_I=64, top_k=256): a budget of
    5.5 x top_k tokens (22 blocks: sink, local, 16 by pooled mean, 4 by spread), tiles of 16
    queries, 128 queries per fine step (how they were chosen: docs/findings.md). Invalid
    values raise ValueError naming the field and the allowed range.

    block_size: tokens per key block (the unit of block summaries and candidates).
    candidate_tokens: candidate budget per query in tokens (rounded up to whole blocks);
      sink, local and bound blocks count against it. Must be >= top_k at call time.
    coarse_keep_ratio: alternative budget, the fraction of the blocks visible to the query
      (the reference's COARSE_THRESHOLD, 0.8 there). Set candidate_tokens=None to use it.
    length_budgets: alternative budget, a rule by context length: ((length, tokens), ...),
      lengths ascending. A call over L keys (the cache up to its length bucket: the chunk's
      context) runs with the tokens of the first entry whose length is >= L, past the last
      entry with the last's. Set candidate_tokens=None to use it. Exactly one of the three
      budgets is set.
    fine_batch_size: queries scored per fine step (one step of a sequential lax.map), which
      bounds memory: O(fine_batch_size * (L / block_size + candidate tokens)).
    sink_blocks: leading blocks always selected (attention sinks).
    local_blocks: most recent blocks always selected, counted back from the block holding
      each query (1 = the query's own block).
    coarse_heads: score blocks with only this many indexer heads (None = all), chosen per
      query by `coarse_head_select`: "max_abs_weight" (largest |w|) or "first".
    query_tile: consecutive queries whose candidate blocks are merged into one block table,
      so the fine stage is one dense [query_tile * H_I, d_I] x [d_I, table tokens] product
      per tile (1 = one table per query: a gather per query).
    tile_candidate_tokens: size of a tile's table in tokens (None = 2 x the per-query
      budget): the union of its queries' lists, best rank first; when the union is larger,
      the blocks no query of the tile ranks high are cut.
    share_tile_candidates: False = each query ranks its own candidate blocks (found in the
      table); True = every token of its tile's table (more candidates, slower top_k).
    bound_blocks: this many of each query's candidate blocks are chosen by spread instead of
      pooled mean: in approximate mode by coarse score + (block radius x a per-query factor),
      in exact mode by the upper bound; this finds blocks whose mean hides one outstanding
      token (a "needle").
    fast_ranking: in approximate mode, rank each query's candidate tokens by a threshold
      instead of lax.top_k (scoring.threshold_topk: on CPU 2x faster than a sort of
      packed keys at 4096 columns, 2-3.4x than lax.top_k read newest first past them;
      scores within (row max - row min) x 2^-20 of the k-th may swap places;
      the tokens are not ordered best first). Exact mode never does.
    exact: after the approximate pass, keep rescoring blocks whose upper bound reaches the
      current k-th score until none does: the result equals flat top_k (ties aside).
    refine_blocks: blocks per query tile rescored in each exact-mode round.
    coarse: the coarse scorer: "mean" (pooled mean keys) or "learned" (the trained coarse
      screen of indexer.coarse_screen: learned per-dimension scales of each query against
      the blocks' [mean | max | min]; its parameters come from the model, see
      indexer.CoarseScreen).
    coarse_mass: adaptive budget (None: off). Each query keeps the fewest of its best
      blocks whose softmax mass over the coarse scores (at coarse_temperature) reaches this
      threshold, in (0, 1], plus its forced blocks; candidate_tokens / coarse_keep_ratio
      is then the maximum. Shapes are static, so the cost follows the largest need of each
      chunk of fine_batch_size queries, rounded up to one of `mass_buckets` fractions of
      the maximum (one compiled branch each, lax.switch).
    coarse_temperature: the softmax temperature of the mass rule; None: the screen's own
      trained temperature (indexer.CoarseScreen; 1.0 for an untrained one).
    mass_buckets: the fractions of the maximum budget the mass rule can run at
      (ascending, the last 1.0).
    """

    block_size: int = 64
    candidate_tokens: int | None = offered(1408, ge=1,
                                           clears=("coarse_keep_ratio", "length_budgets"))
    coarse_keep_ratio: float | None = offered(None, name="coarse_threshold", gt=0.0, le=1.0,
                                              clears=("candidate_tokens", "length_budgets"))
    length_budgets: tuple | None = None
    fine_batch_size: int = offered(128, ge=1)
    sink_blocks: int = 1
    local_blocks: int = 1
    coarse_heads: int | None = None
    coarse_head_select: str = "max_abs_weight"
    query_tile: int = 16
    tile_candidate_tokens: int | None = None
    share_tile_candidates: bool = False
    bound_blocks: int = 4
    fast_ranking: bool = True
    exact: bool = False
    refine_blocks: int = 32
    coarse: str = offered("mean", choices=COARSE_KINDS)
    coarse_mass: float | None = offered(None, gt=0.0, le=1.0)
    coarse_temperature: float | None = None
    mass_buckets: tuple[float, ...] = (0.25, 0.5, 1.0)

    def __post_init__(self):
        def fail(name, allowed):
            raise ValueError(f"HierarchicalConfig.{name} must be {allowed}, "
                             f"got {getattr(self, name)!r}")

        def check_int(name, lo, hi=_INT_MAX, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                fail(name, f"{'None or ' if optional else ''}an int in [{lo}, {hi}]")

        check_int("block_size", 1, 65536)
        check_int("candidate_tokens", 1, optional=True)
        check_int("fine_batch_size", 1)
        check_int("sink_blocks", 0)
        check_int("local_blocks", 1)
        check_int("coarse_heads", 1, optional=True)
        check_int("query_tile", 1, 65536)
        check_int("tile_candidate_tokens", 1, optional=True)
        check_int("bound_blocks", 0)
        check_int("refine_blocks", 1)
        ratio = self.coarse_keep_ratio
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                                  or not 0.0 < ratio <= 1.0):
            fail("coarse_keep_ratio", "None or a number in (0, 1]")
        rule = self.length_budgets
        if rule is not None:
            try:
                rule = tuple((length, tokens) for length, tokens in rule)
            except (TypeError, ValueError):
                rule = None
            if (not rule or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                                for pair in rule for x in pair)
                    or [n for n, _ in rule] != sorted({n for n, _ in rule})):
                fail("length_budgets", "None or ((length, tokens), ...) of positive ints, "
                                       "lengths ascending and distinct")
            object.__setattr__(self, "length_budgets", rule)
        budgets = {"candidate_tokens": self.candidate_tokens, "coarse_keep_ratio": ratio,
                   "length_budgets": rule}
        if sum(v is not None for v in budgets.values()) != 1:
            raise ValueError("HierarchicalConfig: set exactly one of candidate_tokens and "
                             "coarse_keep_ratio (set candidate_tokens=None to use "
                             "coarse_keep_ratio), or length_budgets; got "
                             + ", ".join(f"{k}={v!r}" for k, v in budgets.items()))
        if self.coarse not in COARSE_KINDS:
            fail("coarse", f"one of {COARSE_KINDS}")
        for name in ("coarse_mass", "coarse_temperature"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not value > 0 or (name == "coarse_mass"
                                                             and value > 1)):
                fail(name, "None or a number in (0, 1]" if name == "coarse_mass"
                     else "None or a number > 0")
        buckets = self.mass_buckets
        if isinstance(buckets, list):
            object.__setattr__(self, "mass_buckets", tuple(buckets))
            buckets = self.mass_buckets
        if (not isinstance(buckets, tuple) or not buckets
                or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in buckets)
                or list(buckets) != sorted(set(buckets)) or not 0 < buckets[0]
                or buckets[-1] != 1.0):
            fail("mass_buckets", "ascending distinct fractions in (0, 1] ending with 1.0")
        if self.coarse_mass is not None and self.exact:
            raise ValueError("HierarchicalConfig: coarse_mass (an adaptive budget) and exact "
                             "(certified equal to flat) cannot be combined")
        if self.coarse_head_select not in HEAD_SELECT_KINDS:
            fail("coarse_head_select", f"one of {HEAD_SELECT_KINDS}")
        for name in ("exact", "share_tile_candidates", "fast_ranking"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a bool")
        if self.fine_batch_size % self.query_tile:
            raise ValueError(f"HierarchicalConfig.fine_batch_size ({self.fine_batch_size}) must be "
                             f"a multiple of query_tile ({self.query_tile})")

    def budget_tokens(self, length):
        """The candidate budget in tokens of a call over `length` keys (None: the
        coarse_keep_ratio rule, a share of each query's visible blocks)."""
        if self.length_budgets is not None:
            return next((tokens for upto, tokens in self.length_budgets if upto >= length),
                        self.length_budgets[-1][1])
        return self.candidate_tokens

    def min_budget_tokens(self):
        """The smallest budget in tokens any call runs with (None: the ratio rule)."""
        if self.length_budgets is not None:
            return min(tokens for _, tokens in self.length_budgets)
        return self.candidate_tokens

    def candidate_blocks(self, n_blocks):
        """The budget in whole blocks for a context of n_blocks blocks (static)."""
        budget = self.budget_tokens(n_blocks * self.block_size)
        if budget is not None:
            return -(-budget // self.block_size)
        return max(1, math.ceil(self.coarse_keep_ratio * n_blocks - 1e-9))


class HierarchicalPlan(NamedTuple):
    """Static sizes of one hierarchical_topk call (see hierarchical_plan)."""

    tile: int  # queries per tile
    chunk: int  # queries per lax.map step
    n_chunks: int
    n_blocks: int
    n_cand: int  # candidate blocks per query
    n_union: int  # blocks in a tile's table
    own: bool  # rank each query over its own candidates (else the tile's union)
    buckets: tuple  # mass rule: ((candidate blocks, table blocks), ...) ascending; else ()


def hierarchical_plan(config, T, L, top_k, H):
    """Static sizes of one hierarchical_topk call of T queries over L keys with H heads
    (ValueError on a budget below top_k or more coarse heads than H)."""
    B = config.block_size
    budget = config.budget_tokens(L)
    if budget is not None and budget < top_k:
        which = f"length_budgets at {L} keys" if config.length_budgets else "candidate_tokens"
        raise ValueError(f"HierarchicalConfig.{which} ({budget}) must be >= top_k ({top_k})")
    if config.coarse_heads is not None and config.coarse_heads > H:
        raise ValueError(f"HierarchicalConfig.coarse_heads ({config.coarse_heads}) must be in "
                         f"[1, index heads = {H}]")
    tile = min(config.query_tile, T)
    chunk = min(config.fine_batch_size, -(-T // tile) * tile)
    nb = -(-int(L) // B)
    forced = config.sink_blocks + config.local_blocks + config.bound_blocks
    n_cand = min(nb, max(config.candidate_blocks(nb), forced))
    if tile == 1:
        n_union = n_cand
    else:
        tile_tokens = config.tile_candidate_tokens or 2 * n_cand * B
        n_union = min(nb, max(n_cand, -(-tile_tokens // B)))
    own = tile > 1 and not config.share_tile_candidates
    buckets = ()
    if config.coarse_mass is not None:
        sizes = sorted({min(n_cand, max(forced, math.ceil(f * n_cand - 1e-9)))
                        for f in config.mass_buckets})
        buckets = tuple((m, min(nb, max(m, math.ceil(n_union * m / n_cand)))) for m in sizes)
    return HierarchicalPlan(tile, chunk, -(-T // chunk), nb, n_cand, n_union, own, buckets)


@dataclasses.dataclass(frozen=True)
class FlatConfig(FrozenConfig):
    """Settings of the flat selection (every earlier token scored, top_k kept).

    fast_ranking: rank each query's scores by a threshold (indexer.scoring.threshold_topk,
      as HierarchicalConfig.fast_ranking does for its candidates) instead of lax.top_k.
      XLA sorts for lax.top_k on a CPU: 1024 rows of 8192 scores took 262 ms there, the
      threshold 183 ms (4096: 186 / 74 ms). Scores within (row max - row min) x 2^-20 of
      the k-th may swap places, and the indices are not best first. Off by default: flat is
      the exact reference; the TTFT study turns it on for flat and hierarchical alike, so
      their ratio is not a sort against a threshold."""

    fast_ranking: bool = False

    def __post_init__(self):
        if not isinstance(self.fast_ranking, bool):
            raise ValueError(f"FlatConfig.fast_ranking must be true or false, got "
                             f"{self.fast_ranking!r}")


@dataclasses.dataclass(frozen=True)
class YarnConfig(FrozenConfig):
    """YaRN RoPE scaling (arXiv 2309.00071) as DeepSeek-V3.2 and GLM-5 configure it
    (transformers' `rope_parameters` with rope_type "yarn"): rotary frequencies blended
    between interpolated (divided by `factor`) and original ones over a ramp between the
    dimensions that rotate beta_fast and beta_slow times within
    original_max_position_embeddings; cos/sin scaled by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) (attention_factor, when given, instead); and attention's
    softmax scale multiplied by mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set.
    mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1. Lives here because the indexer's RoPE
    uses the same frequencies. Invalid values raise ValueError naming the field."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        for name in ("factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"YarnConfig.{name} must be a positive number, got {value!r}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"YarnConfig.{name} must be None or a number >= 0, "
                                 f"got {value!r}")
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"YarnConfig.original_max_position_embeddings must be a positive "
                             f"int, got {value!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"YarnConfig.truncate must be a bool, got {self.truncate!r}")

    @staticmethod
    def _mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    def cos_sin_factor(self):
        """What cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(self.factor,
                                                                        self.mscale_all_dim)
        return self._mscale(self.factor)

    def softmax_scale_factor(self):
        """What attention's softmax scale is multiplied by (MLA's mscale^2)."""
        if not self.mscale_all_dim:
            return 1.0
        return self._mscale(self.factor, self.mscale_all_dim) ** 2

    def inverse_frequencies(self, dim, theta):
        """The blended inverse frequencies of a RoPE of `dim` dims: a list of dim // 2 floats."""
        def correction_dim(rotations):
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as the reference does, against a zero-width ramp
        out = []
        for i in range(dim // 2):
            base = theta ** (2 * i / dim)
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation = 1.0 - ramp  # share of the original frequency
            out.append((1.0 / (self.factor * base)) * (1 - extrapolation)
                       + (1.0 / base) * extrapolation)
        return out
