"""The selection kinds: one table, read by everything that runs, offers, shards or counts a
selection (the model's config and forward pass, sequence-parallel prefill, serving's config
and metrics, the main job's modes, the cost model).

A kind is one `SelectionKind` entry: its select function, the config class it reads, whether
serving offers it, its per-shard query tile (sequence-parallel prefill splits a chunk's
queries into pieces that are whole tiles, so each query ranks the same candidates as on one
device) and its cost (`indexer.costs`: FLOPs, bytes and top-k work of one call). Adding a
kind is one entry here (or `register_selection` from outside) plus its function.

This module imports no JAX: serving reads the table before JAX starts. A select function
given as "module:name" is imported on first use.

Every select function has one signature:

    select(q, w, k, top_k, *, q_offset, config, summaries, screen[, key_ratio]) -> i32[T, top_k]

q [T, H_I, d_I], w [T, H_I], k [L, d_I] (the indexer-key cache up to a length bucket; keys
past the queries are masked by causality); query i sits at position q_offset + i. config:
the layer's HierarchicalConfig (kinds that have no knobs ignore it); summaries: the cache's
BlockSummaryCache of k (at least ceil(L / block_size) blocks); screen: the layer's trained
coarse screen (indexer.ScreenParams) or None. key_ratio (given only when > 1): each key
summarises key_ratio positions, [s key_ratio, (s + 1) key_ratio), and a query sees it once
all of them are at or before its position (DeepSeek-V4's CSA entries; block summaries and
a kind's settings then count keys, not positions). Output: the chosen tokens, -1 in the last
slots where fewer than top_k are chosen; best first, except the hierarchical kind's fast
ranking (unordered): consumers read them as a set.

A kind whose `scores` is "attention" ranks by the layer's own dense attention instead of the
indexer (the oracle: what the best possible indexer would keep under DSA's rule of one set
shared by all heads). Its select function is

    select(target, top_k, *, q_offset) -> i32[T, top_k]

target f32[T, kv_len]: the layer's dense attention probabilities averaged over heads (the
indexer's KL target), computed in the same pass; it measures, it is never served.
"""

import dataclasses
import importlib
from collections.abc import Callable

from indexer.config import FlatConfig, HierarchicalConfig, Offered
from indexer.costs import flat_ops, hierarchical_ops, oracle_ops, streaming_ops, window_ops


def _single_query_tile(config, T):
    return 1


def _hierarchical_query_tile(config, T):
    return min(config.query_tile, T)


@dataclasses.dataclass(frozen=True)
class SelectionKind:
    """One selection kind.

    name: what ModelConfig.indexer (and serving's `indexer`) says.
    select: the function (see the module docstring), or "module:name" imported on first use.
    description: one line for errors and docs.
    costs: (indexer.costs.Selection, T, p0, kv_len, skip) -> [indexer.costs.Op], the work
      of one call (the FLOP estimate of serving's metrics and the cost model).
    config: its settings class, a frozen dataclass (None: it has none). ModelConfig holds
      one instance per kind and hands each layer its own (ModelConfig.layer_settings); the
      fields marked with indexer.config.offered are serving's and the CLIs' switches.
    served: whether `python -m serving` offers it (baselines that only measure are not).
    query_tile: (config, T) -> queries that must stay together on one shard.
    scores: "indexer" (the lightning indexer's inputs) or "attention" (the layer's dense
      attention, head-averaged: the oracle; see the module docstring).
    """

    name: str
    select: Callable | str
    description: str
    costs: Callable
    config: type | None = None
    served: bool = True
    query_tile: Callable = _single_query_tile
    scores: str = "indexer"

    def __post_init__(self):
        if self.scores not in ("indexer", "attention"):
            raise ValueError(f"SelectionKind.scores must be 'indexer' or 'attention', got "
                             f"{self.scores!r}")

    @property
    def function(self):
        if callable(self.select):
            return self.select
        module, _, attr = self.select.partition(":")
        return getattr(importlib.import_module(module), attr)


SELECTIONS = {kind.name: kind for kind in (
    SelectionKind("flat", "indexer.scoring:flat_select",
                  "exact top_k of the lightning indexer's scores over every earlier token",
                  flat_ops, config=FlatConfig),
    SelectionKind("hierarchical", "indexer.hierarchical:hierarchical_select",
                  "coarse-to-fine: score key blocks, then tokens inside the best blocks",
                  hierarchical_ops, config=HierarchicalConfig,
                  query_tile=_hierarchical_query_tile),
    SelectionKind("streaming", "indexer.streaming:streaming_select",
                  "flat's exact top_k computed one key tile at a time into a running top_k: "
                  "the same selection, never a [queries x context] score matrix",
                  streaming_ops),
    SelectionKind("window", "indexer.scoring:window_select",
                  "the query and the top_k - 1 tokens before it, no scoring (the baseline "
                  "that measures what selection costs)", window_ops, served=False),
    SelectionKind("oracle", "indexer.scoring:oracle_select",
                  "top_k of the layer's own dense attention averaged over heads, one set for "
                  "all heads (the limit any indexer can reach under DSA's rule)", oracle_ops,
                  served=False, scores="attention"),
)}


def selection_names(*, served=None):
    """The kinds' names (served=True: only those serving offers)."""
    return tuple(name for name, kind in SELECTIONS.items()
                 if served is None or kind.served == served)


def selection_kind(name, *, what="indexer", served=False):
    """The SelectionKind called `name`; ValueError naming `what` and the allowed kinds (only
    the served ones when served=True)."""
    allowed = selection_names(served=True if served else None)
    if not isinstance(name, str) or name not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {name!r}")
    return SELECTIONS[name]


@dataclasses.dataclass(frozen=True)
class OfferedSetting:
    """A switch serving and the CLIs offer: field `field` of kind `kind`'s settings, under
    `name`; `type` the field's annotation, `how` its indexer.config.Offered mark."""

    name: str
    kind: str
    field: str
    type: object
    how: Offered


def offered_settings():
    """{switch name: OfferedSetting} over the served kinds' settings classes, in table and
    field order. ValueError when two kinds offer one name."""
    out = {}
    for kind in SELECTIONS.values():
        if kind.config is None or not kind.served:
            continue
        for f in dataclasses.fields(kind.config):
            how = f.metadata.get("offered")
            if how is None:
                continue
            name = how.name or f.name
            if name in out:
                raise ValueError(f"selection kinds {out[name].kind!r} and {kind.name!r} both "
                                 f"offer a switch named {name!r}")
            out[name] = OfferedSetting(name, kind.name, f.name, f.type, how)
    return out


def settings_overrides(values):
    """{switch name: value} (None values skipped) -> {kind name: {settings field: value}},
    the fields each switch clears set to None. ValueError naming an unknown switch, or two
    switches one clears."""
    offered = offered_settings()
    out, given = {}, {}
    for name, value in values.items():
        if value is None:
            continue
        if name not in offered:
            raise ValueError(f"unknown selection switch {name!r}; offered: {sorted(offered)}")
        setting = offered[name]
        fields = out.setdefault(setting.kind, {})
        for cleared in setting.how.clears:
            other = given.get((setting.kind, cleared))
            if other is not None:
                raise ValueError(f"set at most one of {other} and {name}, got both")
            fields[cleared] = None
        fields[setting.field] = value
        given[(setting.kind, setting.field)] = name
    return out


def register_selection(kind):
    """Adds a kind to the table (replacing one of the same name) -> the kind it replaced, or
    None. For kinds defined outside this package (experiments, tests)."""
    if not isinstance(kind, SelectionKind):
        raise TypeError(f"register_selection takes a SelectionKind, got {type(kind).__name__}")
    old = SELECTIONS.get(kind.name)
    SELECTIONS[kind.name] = kind
    return old


def unregister_selection(name, previous=None):
    """Removes kind `name` (restoring `previous`, what register_selection returned)."""
    if previous is None:
        SELECTIONS.pop(name, None)
    else:
        SELECTIONS[name] = previous
