"""The attention kinds, one entry each (as indexer/selection.py holds the selection kinds):
the module a layer of the kind builds, the rule that selects it for a layer of a config,
the fields its layers cache, the width of the indexer's query input, and its parameters'
logical axes. The kind is chosen per layer (DeepSeek-V4 mixes sliding, CSA and HCA layers
in one stack). model.transformer builds the kind's module, model.cache allocates its
fields, model.sharding places its parameters by these axes, and model.costs counts it by
its entry in model.costs.ATTENTION_COSTS. A new kind is its module, its entry here and its
cost entry.
"""

import dataclasses
from collections.abc import Callable

from indexer.block_summaries import SUMMARY_LAYOUT
from model.attention import Attention
from model.cache_field import CacheField, model_dtype
from model.deepseek_v4.modules import (
    CSA_SUMMARY_PREFIX,
    Compressor,
    CSAttention,
    HCAttention,
    SlidingAttention,
)
from model.mla import MLAttention


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """name: the kind's name. module: its nnx.Module class, built as module(config, rngs=,
    dtype=, param_dtype=), with members project, read, output and scale (model.attention).
    section: the ModelConfig field whose value selects the kind (None: the default kind,
    when no other kind's section is set). cache_fields: {name: CacheField} of the "kv" part
    a layer of this kind caches (its module's `project` returns their rows by name).
    indexer_query_dim: config -> the width of the indexer's query input the module hands
    it (None: the hidden state, d_model). param_axes: (path regex, logical axes) of its
    parameters, model.sharding's PARAM_RULES form."""

    name: str
    module: type
    selects: Callable | None
    cache_fields: dict
    indexer_query_dim: Callable
    param_axes: tuple
    self_indexed: bool = False


def _v4_head(c):
    return (c.head_dim,)


# Sliding window ring shared by the three V4 kinds (the same field object: one home).
_V4_WINDOW = CacheField("kv", _v4_head, model_dtype, ("window", "head_dim"),
                        fixed_rows=lambda c: c.v4.sliding_window)


def _v4_compressed_fields(kind):
    """A compressed kind's entries (a row per its ratio positions) and its compressor's
    tail ring; CSA's indexer keeps the same pair at index_dim ("index" part)."""
    if kind == "sliding":
        return {}
    overlap = kind == "csa"
    ratio = f"v4.{kind}_ratio"

    def tail(part, dim, fill):
        width = lambda c: (2 if overlap else 1) * dim(c)  # noqa: E731
        return CacheField(part, lambda c: (width(c),), model_dtype, ("window", None), fill,
                          fixed_rows=lambda c: Compressor.tail_rows(getattr(c.v4, f"{kind}_ratio"),
                                                              overlap))

    def group(prefix, part, dim):
        return {f"{prefix}_entries": CacheField(part, lambda c: (dim(c),), model_dtype,
                                                ("entries", None), 0.0, ratio),
                f"{prefix}_tail_kv": tail(part, dim, 0.0),
                f"{prefix}_tail_gate": tail(part, dim, float("-inf"))}

    fields = group(kind, "kv", lambda c: c.head_dim)
    if overlap:
        fields.update(group("csa_index", "index", lambda c: c.index_dim))
        # The hierarchical selection's summaries of the indexer's entries, a row per
        # block of hierarchical.block_size entries (indexer.block_summaries' layout).
        fields.update({
            f"{CSA_SUMMARY_PREFIX}{name}": CacheField(
                "index", (lambda c: (c.index_dim,)) if per_dim else (lambda c: ()),
                lambda c, dtype=dtype: dtype,
                ("blocks", "index_dim") if per_dim else ("blocks",), fill,
                (ratio, "hierarchical.block_size"))
            for name, (dtype, per_dim, fill) in SUMMARY_LAYOUT.items()})
    return fields


ATTENTION_KINDS = {kind.name: kind for kind in (
    AttentionKind(
        "gqa", Attention, None,
        {"k": CacheField("kv", lambda c: (c.n_kv_heads, c.head_dim), model_dtype,
                         ("cache_seq", "kv_heads", "head_dim")),
         "v": CacheField("kv", lambda c: (c.n_kv_heads, c.head_dim), model_dtype,
                         ("cache_seq", "kv_heads", "head_dim"))},
        lambda c: None,
        ((r"attn/wq/kernel$", ("embed", "heads")),
         (r"attn/w[kv]/kernel$", ("embed", "kv_heads")),
         (r"attn/wo/kernel$", ("heads", "embed")))),
    AttentionKind(
        # MLA (model/mla.py): [c | k_rope] per token, one head shared by every attention
        # head; V3.2's indexer reads its queries from the q-LoRA residual.
        "mla", MLAttention, lambda c, layer: c.mla is not None,
        {"kv_latent": CacheField("kv", lambda c: (c.mla.latent_dim,), model_dtype,
                                 ("cache_seq", "latent"))},
        lambda c: c.mla.q_lora_rank,
        # The low-rank down-projections and the latent stay whole (one latent head serves
        # every attention head); the up-projections split over heads.
        ((r"attn/(q_a|kv_a)/kernel$", ("embed", "latent")),
         (r"attn/(q_a_norm|kv_a_norm)/scale$", ("latent",)),
         (r"attn/(q_b|kv_b)/kernel$", ("latent", "heads")),
         (r"attn/wo/kernel$", ("heads", "embed")))),
    # DeepSeek-V4 (model/deepseek_v4/modules.py): every layer attends its last
    # sliding_window tokens (the "window" ring, a constant per layer); CSA and HCA layers
    # also their compressed entries, a row per `ratio` positions, and the compressors'
    # tails. The weights stay whole on every device (tensor parallelism for V4: not yet).
    *(AttentionKind(
        kind, module, lambda c, layer, kind=kind: c.v4 is not None and
        c.v4.layer_types[layer] == kind,
        {"window": _V4_WINDOW, **_v4_compressed_fields(kind)},
        lambda c: None, ((r"attn/", None),), self_indexed=True)
      for kind, module in (("sliding", SlidingAttention), ("csa", CSAttention),
                           ("hca", HCAttention))),
)}


def attention_kind(config, layer=0):
    """The AttentionKind of layer `layer`: the one that selects it, else the default kind.
    ValueError when several select it."""
    chosen = [k for k in ATTENTION_KINDS.values()
              if k.selects is not None and k.selects(config, layer)]
    if len(chosen) > 1:
        raise ValueError(f"several attention kinds select layer {layer} of this config: "
                         f"{[k.name for k in chosen]}")
    if chosen:
        return chosen[0]
    return next(k for k in ATTENTION_KINDS.values() if k.selects is None)


def register_attention(kind):
    """Adds (or replaces) an entry -> the entry it replaced, or None (for
    unregister_attention). For kinds defined outside this package (tests, experiments).
    ValueError when another kind already declares one of its cache fields."""
    if not isinstance(kind, AttentionKind):
        raise TypeError(f"register_attention takes an AttentionKind, got {type(kind).__name__}")
    clash = sorted(name for other in ATTENTION_KINDS.values() if other.name != kind.name
                   for name, f in other.cache_fields.items()
                   if name in kind.cache_fields and kind.cache_fields[name] is not f)
    if clash:
        raise ValueError(f"attention kind {kind.name!r}: cache fields {clash} belong to "
                         f"another kind")
    previous = ATTENTION_KINDS.get(kind.name)
    ATTENTION_KINDS[kind.name] = kind
    return previous


def unregister_attention(name, previous=None):
    """Removes entry `name`, or puts back `previous` (what register_attention returned)."""
    if previous is None:
        ATTENTION_KINDS.pop(name, None)
    else:
        ATTENTION_KINDS[name] = previous
