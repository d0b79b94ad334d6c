"""Model configuration: one frozen, validated dataclass and named presets."""

import dataclasses
import json

from indexer.config import FrozenConfig, HierarchicalConfig, YarnConfig
from indexer.selection import selection_kind
from model.architecture import DeepseekV4Config, MLAConfig, MoEConfig

ATTENTION_KINDS = ("dense", "sparse")
DTYPES = ("float32", "bfloat16")
INDEXER_TYPES = ("full", "shared")  # GLM-5's names: a layer runs its indexer, or reuses one
_PATTERN_LETTERS = {"F": "full", "S": "shared"}


def glm_indexer_types(n_layers, *, index_topk_freq=1, index_skip_topk_offset=2):
    """GLM-5's schedule of full and shared layers (transformers' GlmMoeDsaConfig): layer i
    is full when max(i - offset + 1, 0) is a multiple of the frequency, so the first
    `offset` layers are full and then one in `index_topk_freq`."""
    for name, value, lo in (("index_topk_freq", index_topk_freq, 1),
                            ("index_skip_topk_offset", index_skip_topk_offset, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"ModelConfig.indexer_types: {name} must be an int >= {lo}, "
                             f"got {value!r}")
    return tuple("full" if max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0
                 else "shared" for i in range(n_layers))


def reuse_types(reuse):
    """A short reuse spelling (a method's "@..." suffix, a benchmark's --reuse) ->
    ModelConfig.indexer_types: "freqN" keeps the indexer of layers 0, N, 2N, ... (the others
    reuse the last kept layer's selection; GLM-5's schedule with offset 1), anything else is
    an F/S pattern string (F: the layer runs its indexer, S: it reuses)."""
    if reuse.startswith("freq") and reuse[4:].isdigit():
        return {"index_topk_freq": int(reuse[4:]), "index_skip_topk_offset": 1}
    return reuse


def normalize_indexer_types(value, n_layers):
    """ModelConfig.indexer_types in any of its spellings -> a tuple of "full" / "shared" per
    layer, or () when every layer is full (the same config as not saying it). Spellings:
    a list of "full" / "shared"; a pattern string such as "FFSS..." (F full, S shared); a
    mapping {index_topk_freq, index_skip_topk_offset} or {index_topk_pattern} as GLM-5's
    config writes it. n_layers None: the model is not known yet (a serving config): the
    spelling is checked and a schedule mapping is returned as given. ValueError naming the
    field and what is allowed."""
    where = "ModelConfig.indexer_types"
    if isinstance(value, dict):
        if "index_topk_pattern" in value:
            if set(value) != {"index_topk_pattern"}:
                raise ValueError(f"{where}: index_topk_pattern excludes other keys, got "
                                 f"{sorted(value)}")
            value = value["index_topk_pattern"]
        else:
            unknown = sorted(set(value) - {"index_topk_freq", "index_skip_topk_offset"})
            if unknown:
                raise ValueError(f"{where}: unknown keys {unknown}; allowed: index_topk_freq, "
                                 "index_skip_topk_offset, index_topk_pattern")
            schedule = glm_indexer_types(1 if n_layers is None else n_layers, **value)
            if n_layers is None:
                return dict(value)
            value = schedule
    if isinstance(value, str):
        if any(c not in _PATTERN_LETTERS for c in value):
            raise ValueError(f"{where}: a pattern string takes only the letters F (full) and "
                             f"S (shared), got {value!r}")
        value = [_PATTERN_LETTERS[c] for c in value]
    if not isinstance(value, (tuple, list)) or any(t not in INDEXER_TYPES for t in value):
        raise ValueError(f"{where} must be empty (every layer full), one entry per layer from "
                         f"{INDEXER_TYPES}, a pattern such as 'FFSS' or GLM-5's "
                         f"{{index_topk_freq, index_skip_topk_offset}}, got {value!r}")
    value = tuple(value)
    if n_layers is not None and value and len(value) != n_layers:
        raise ValueError(f"{where} must have one entry per layer ({n_layers}), got {len(value)}")
    if value and value[0] != "full":
        raise ValueError(f"{where}: layer 0 must be 'full' (a shared layer reuses the selection "
                         f"of an earlier full layer), got {value[0]!r}")
    return () if all(t == "full" for t in value) else value


@dataclasses.dataclass(frozen=True)
class ModelConfig(FrozenConfig):
    """Shapes and switches of a DSA decoder-only transformer.

    Attention is grouped-query (n_heads a multiple of n_kv_heads). Each layer has a
    lightning indexer (index_heads x index_dim, RoPE on the first index_rope_dim dims,
    rotate-half layout); with attention="sparse" every query attends to the top_k tokens
    the indexer selects (shared by all heads of the query). indexer="hierarchical" selects
    them coarse-to-fine with the knobs in `hierarchical` (a HierarchicalConfig; a dict is
    converted). flat_index_layers: layers whose selection stays flat when
    indexer="hierarchical" (e.g. (0,) for a first layer whose top-k is a few byte values
    scattered over the whole context, which no block selector covers: docs/findings.md).
    dense_layers: layers that keep dense attention when attention="sparse" (their indexer
    still runs, so its keys stay cached and trainable). tie_embeddings: the output
    projection is the token embedding's transpose (Llama-family checkpoints such as
    SmolLM2). layer_candidate_tokens: per-layer hierarchical budgets in tokens (one per
    layer; empty: hierarchical's shared budget). indexer_types: per-layer selection reuse
    (GLM-5's field, IndexCache): "full" (the layer runs its indexer) or "shared" (it has no
    indexer, caches no index keys and attends to the selection of the nearest earlier full
    layer); empty: every layer full; layer 0 must be full; other spellings:
    normalize_indexer_types. DeepSeek-style models (V3.2, GLM-5: docs/models.md): mla (an
    MLAConfig: multi-head latent attention instead of GQA; n_kv_heads and head_dim are then
    unused; the indexer's queries come from the q-LoRA residual), moe (a MoEConfig: the
    DeepSeekMoE feed-forward in its "sparse" layers), yarn (a YarnConfig: YaRN RoPE
    frequencies for attention and the indexer), index_rope_interleaved (the indexer's rotary
    dims hold interleaved pairs: GLM-5), v4 (a DeepseekV4Config: DeepSeek-V4's sliding,
    CSA and HCA layers with hyper-connections; head_dim is then its shared K = V head,
    index_heads / index_dim / top_k its CSA indexer's, which selects compressed entries
    flat; n_kv_heads is unused). dtype: the compute and cache dtype; param_dtype:
    how the weights are stored ("float32", the default: training keeps float32 weights;
    a checkpoint loaded for inference stores them in its own dtype, e.g. bfloat16 for
    DeepSeek-V3.2, so the weights take the bytes the checkpoint does; norms and the MoE
    router stay float32). Invalid values raise ValueError naming the field and the allowed
    range.
    """

    vocab_size: int = 259
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 768
    max_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_scaling: float = 1.0  # position interpolation factor for contexts longer than training
    # The indexer's own factor (None: rope_scaling). Its top-k follows its rotary scores,
    # which alias at distances never seen in training; interpolating only the indexer keeps
    # them in range while the main attention stays exact (docs/findings.md, "Long context").
    index_rope_scaling: float | None = None
    norm_eps: float = 1e-6
    index_heads: int = 4
    index_dim: int = 64
    index_rope_dim: int = 32
    top_k: int = 256
    attention: str = "sparse"
    indexer: str = "flat"
    flat_index_layers: tuple[int, ...] = ()
    dense_layers: tuple[int, ...] = ()
    layer_candidate_tokens: tuple[int, ...] = ()
    indexer_types: tuple[str, ...] = ()
    tie_embeddings: bool = False
    prefill_chunk: int = 1024
    dtype: str = "float32"
    param_dtype: str = "float32"
    hierarchical: HierarchicalConfig = HierarchicalConfig()
    selection_settings: tuple = ()
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    yarn: YarnConfig | None = None
    index_rope_interleaved: bool = False
    v4: DeepseekV4Config | None = None

    def __post_init__(self):
        for name, kind, optional in (("hierarchical", HierarchicalConfig, False),
                                     ("mla", MLAConfig, True), ("moe", MoEConfig, True),
                                     ("yarn", YarnConfig, True), ("v4", DeepseekV4Config, True)):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, value := kind.from_dict(value))
            if not (isinstance(value, kind) or (optional and value is None)):
                raise ValueError(f"ModelConfig.{name} must be a {kind.__name__} or a dict"
                                 f"{', or None' if optional else ''}, got "
                                 f"{type(value).__name__}")
        object.__setattr__(self, "selection_settings",
                           _normalize_settings(self.selection_settings))
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "d_ff", "max_seq_len", "index_heads", "index_dim", "top_k", "prefill_chunk")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "rope_scaling", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if self.index_rope_scaling is not None and (
                isinstance(self.index_rope_scaling, bool)
                or not isinstance(self.index_rope_scaling, (int, float))
                or self.index_rope_scaling <= 0):
            raise ValueError(f"ModelConfig.index_rope_scaling must be None or a positive number, "
                             f"got {self.index_rope_scaling!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not (0 <= self.index_rope_dim <= self.index_dim and self.index_rope_dim % 2 == 0):
            raise ValueError(f"ModelConfig.index_rope_dim must be even and in [0, index_dim="
                             f"{self.index_dim}], got {self.index_rope_dim}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool, "
                             f"got {self.tie_embeddings!r}")
        for name, allowed in (("attention", ATTENTION_KINDS), ("dtype", DTYPES),
                              ("param_dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        selection_kind(self.indexer, what="ModelConfig.indexer")
        for name in ("flat_index_layers", "dense_layers"):
            layers = getattr(self, name)
            if not isinstance(layers, (tuple, list)) or any(
                    isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers
                    for i in layers) or len(set(layers)) != len(layers):
                raise ValueError(f"ModelConfig.{name} must be distinct layer indices in "
                                 f"[0, n_layers - 1 = {self.n_layers - 1}], got {layers!r}")
            object.__setattr__(self, name, tuple(sorted(layers)))  # hashable
        per_layer = self.layer_candidate_tokens
        if not isinstance(per_layer, (tuple, list)) or (per_layer and (
                len(per_layer) != self.n_layers or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < self.top_k
                    for t in per_layer))):
            raise ValueError(f"ModelConfig.layer_candidate_tokens must be empty (the shared "
                             f"hierarchical budget) or {self.n_layers} ints (one per layer), "
                             f"each >= top_k ({self.top_k}), got {per_layer!r}")
        object.__setattr__(self, "layer_candidate_tokens", tuple(per_layer))
        object.__setattr__(self, "indexer_types",
                           normalize_indexer_types(self.indexer_types, self.n_layers))
        shared = [i for i in self.flat_index_layers if self.layer_is_shared(i)]
        if shared:
            raise ValueError(f"ModelConfig.flat_index_layers: layers {shared} are 'shared' in "
                             "indexer_types: they run no selection of their own")
        if not isinstance(self.index_rope_interleaved, bool):
            raise ValueError(f"ModelConfig.index_rope_interleaved must be a bool, got "
                             f"{self.index_rope_interleaved!r}")
        types = self.moe.mlp_layer_types if self.moe is not None else ()
        if types and len(types) != self.n_layers:
            raise ValueError(f"ModelConfig.moe.mlp_layer_types must have one entry per layer "
                             f"({self.n_layers}), got {len(types)}")
        if self.mla is not None and self.index_rope_dim > self.mla.qk_rope_head_dim:
            raise ValueError(f"ModelConfig.index_rope_dim ({self.index_rope_dim}) must be <= "
                             f"mla.qk_rope_head_dim ({self.mla.qk_rope_head_dim}): the indexer "
                             f"rotates with attention's frequencies")
        if self.v4 is not None:
            self._check_v4()
        budget = self.hierarchical.min_budget_tokens()
        if self.indexer == "hierarchical" and budget is not None and budget < self.top_k:
            which = "length_budgets' tokens" if self.hierarchical.length_budgets else \
                "candidate_tokens"
            raise ValueError(f"ModelConfig.hierarchical.{which} must be >= top_k "
                             f"({self.top_k}), got {budget}")

    def _check_v4(self):
        v4 = self.v4
        if len(v4.layer_types) != self.n_layers:
            raise ValueError(f"ModelConfig.v4.layer_types must have one entry per layer "
                             f"({self.n_layers}), got {len(v4.layer_types)}")
        if self.mla is not None:
            raise ValueError("ModelConfig: v4 and mla are two attention kinds; set one")
        if selection_kind(self.indexer).scores != "indexer":
            raise ValueError(f"ModelConfig.indexer {self.indexer!r} ranks dense attention over "
                             "tokens; DeepSeek-V4's CSA layers select compressed entries by "
                             "their indexer: use flat, streaming or hierarchical")
        if self.indexer == "hierarchical" and self.hierarchical.exact:
            raise ValueError("ModelConfig.hierarchical.exact must be False with v4 (exact mode "
                             "is not available over compressed entries)")
        if self.indexer == "hierarchical" and self.hierarchical.coarse == "learned":
            raise ValueError("ModelConfig.hierarchical.coarse must be 'mean' with v4 (no "
                             "coarse screen is trained over compressed entries)")
        if self.indexer_types:
            raise ValueError("ModelConfig.indexer_types must be empty with v4: every CSA "
                             "layer runs its own indexer")
        if v4.qk_rope_head_dim > min(self.head_dim, self.index_dim):
            raise ValueError(f"ModelConfig.v4.qk_rope_head_dim ({v4.qk_rope_head_dim}) must be "
                             f"<= head_dim ({self.head_dim}) and index_dim ({self.index_dim})")
        if (self.n_heads * self.head_dim) % v4.o_groups:
            raise ValueError(f"ModelConfig.v4.o_groups ({v4.o_groups}) must divide n_heads x "
                             f"head_dim ({self.n_heads * self.head_dim})")

    @property
    def indexer_rope_scaling(self):
        """The position interpolation factor the indexer's RoPE uses."""
        return self.rope_scaling if self.index_rope_scaling is None else self.index_rope_scaling

    def layer_is_sparse(self, layer):
        """Whether layer `layer` attends to the indexer's selection (else dense)."""
        return self.attention == "sparse" and layer not in self.dense_layers

    def layer_is_moe(self, layer):
        """Whether layer `layer`'s feed-forward is the MoE (else the dense SwiGLU)."""
        return self.moe is not None and self.moe.layer_is_moe(layer)

    def layer_is_hashed(self, layer):
        """Whether layer `layer`'s MoE picks its experts by token id (moe.mlp_layer_types)."""
        return self.moe is not None and self.moe.layer_is_hashed(layer)

    def layer_is_shared(self, layer):
        """Whether layer `layer` reuses an earlier layer's selection (indexer_types)."""
        return bool(self.indexer_types) and self.indexer_types[layer] == "shared"

    def selection_source(self, layer):
        """The layer whose selection layer `layer` attends to: itself when full, else the
        nearest earlier full layer."""
        while self.layer_is_shared(layer):
            layer -= 1
        return layer

    def selection_users(self, layer):
        """The layers that attend to full layer `layer`'s selection: itself and the shared
        layers after it up to the next full one."""
        users = [layer]
        while users[-1] + 1 < self.n_layers and self.layer_is_shared(users[-1] + 1):
            users.append(users[-1] + 1)
        return tuple(users)

    def layer_needs_selection(self, layer):
        """Whether full layer `layer` must select: a layer that attends to its selection is
        sparse."""
        return any(self.layer_is_sparse(i) for i in self.selection_users(layer))

    def layer_indexer(self, layer):
        """The selection kind behind layer `layer`'s attention: "flat" for
        flat_index_layers, else `indexer`; a shared layer's is its source layer's."""
        source = self.selection_source(layer)
        return "flat" if source in self.flat_index_layers else self.indexer

    def layer_hierarchical(self, layer):
        """The HierarchicalConfig layer `layer` runs: `hierarchical` with the layer's own
        candidate budget when layer_candidate_tokens names one."""
        if layer is None or not self.layer_candidate_tokens:
            return self.hierarchical
        return self.hierarchical.replace(candidate_tokens=self.layer_candidate_tokens[layer],
                                         coarse_keep_ratio=None, length_budgets=None)

    def settings(self, kind):
        """Selection kind `kind`'s settings (an instance of its SelectionKind.config; None
        when it has none): ModelConfig's field of the kind's name where there is one
        (`hierarchical`, as stored configs spell it), else its entry in
        selection_settings, else the class's defaults."""
        settings_class = selection_kind(kind, what="ModelConfig.indexer").config
        if settings_class is None:
            return None
        if kind in _FIELD_NAMES:
            return getattr(self, kind)
        return dict(self.selection_settings).get(kind) or settings_class()

    def with_settings(self, kind, **changes):
        """This config with `changes` to selection kind `kind`'s settings."""
        new = self.settings(kind).replace(**changes)
        if kind in _FIELD_NAMES:
            return self.replace(**{kind: new})
        return self.replace(selection_settings={**dict(self.selection_settings), kind: new})

    def layer_settings(self, layer):
        """The settings layer `layer`'s selection runs (those of config.layer_indexer(layer);
        a hierarchical layer's carry its own candidate budget when layer_candidate_tokens
        names one; None for a kind without settings)."""
        kind = self.layer_indexer(layer)
        if kind == "hierarchical":
            return self.layer_hierarchical(self.selection_source(layer))
        return self.settings(kind)

    def to_json(self):
        return json.dumps(self.to_dict(), sort_keys=True)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def _normalize_settings(value):
    """ModelConfig.selection_settings ({kind: settings or dict}, or its pairs) -> sorted,
    hashable (kind, settings) pairs; ValueError naming a kind without settings."""
    where = "ModelConfig.selection_settings"
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = dict((k, v) for k, v in items)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must map selection kinds to their settings, got "
                         f"{value!r}") from None
    out = []
    for kind, settings in sorted(pairs.items()):
        settings_class = selection_kind(kind, what=f"{where}: a key").config
        if settings_class is None or kind in _FIELD_NAMES:
            raise ValueError(f"{where}: {kind!r} has " + (
                "no settings" if settings_class is None else f"its own field, `{kind}`"))
        if isinstance(settings, dict):
            settings = settings_class.from_dict(settings)
        if not isinstance(settings, settings_class):
            raise ValueError(f"{where}[{kind!r}] must be a {settings_class.__name__} or a dict, "
                             f"got {type(settings).__name__}")
        out.append((kind, settings))
    return tuple(out)


def keep_layers(config, layers):
    """`config` with only the layers `layers` (indices, in order) of its stack, each keeping
    its per-layer kinds: dense or MoE feed-forward (moe.mlp_layer_types), full or shared
    indexer (indexer_types), its candidate budget, its place in flat_index_layers /
    dense_layers. E.g. keep_layers(v32, [2, 3, 4, 5]): V3.2's last dense layer and three MoE
    layers at full width (timing runs). ValueError naming a bad index or a first kept layer
    that is shared."""
    layers = list(layers)
    if not layers or any(isinstance(i, bool) or not isinstance(i, int)
                         or not 0 <= i < config.n_layers for i in layers):
        raise ValueError(f"keep_layers: layers must be a non-empty list of indices in "
                         f"[0, {config.n_layers - 1}], got {layers!r}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"keep_layers: layers must be distinct, got {layers!r}")
    pick = lambda values: tuple(values[i] for i in layers) if values else ()  # noqa: E731
    renumber = lambda kept: tuple(j for j, i in enumerate(layers) if i in kept)  # noqa: E731
    moe = config.moe
    if moe is not None and moe.mlp_layer_types:
        moe = moe.replace(mlp_layer_types=pick(moe.mlp_layer_types))
    v4 = config.v4
    if v4 is not None:
        v4 = v4.replace(layer_types=pick(v4.layer_types))
    return config.replace(n_layers=len(layers), moe=moe, v4=v4,
                          indexer_types=pick(config.indexer_types),
                          layer_candidate_tokens=pick(config.layer_candidate_tokens),
                          flat_index_layers=renumber(config.flat_index_layers),
                          dense_layers=renumber(config.dense_layers))
