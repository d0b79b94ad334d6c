"""The serving configuration: one frozen, validated dataclass read from YAML.

Keys are case-insensitive, so the reference deployment's spellings (COARSE_THRESHOLD,
FINE_BATCH_SIZE, CACHE_SIZE, GPU_UTILIZATION, TOP_K, ...) load as they are. This module
imports no JAX: `python -m serving` reads it before JAX starts (GPU_UTILIZATION must be in
the environment by then).
"""

import dataclasses
import pathlib

import yaml

from indexer.config import COARSE_KINDS, FrozenConfig
from indexer.selection import selection_names
from model.config import ATTENTION_KINDS, normalize_indexer_types

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "default.yaml"
# shadow_rate when the config leaves it null and the deployed selection is not flat.
DEFAULT_SHADOW_RATE = 0.1
# The model switches a canary may set (the rest of the canary block: CanaryConfig).
SELECTION_SWITCHES = ("attention", "indexer", "top_k", "indexer_types", "coarse_threshold",
                      "candidate_tokens", "coarse", "coarse_mass", "fine_batch_size")


@dataclasses.dataclass(frozen=True)
class ServingConfig(FrozenConfig):
    """What `python -m serving` runs. None for a model switch keeps the model's own value.

    model: "default" (the shipped checkpoint), "tiny" (random, UNTRAINED weights: tests and
      development), a pretrained name (smollm2-135m) or a path (.gguf file, Hugging Face
      folder, dosa checkpoint folder).
    model_version: label on every metric and the id clients send as "model" (None: derived
      from the model).
    attention, indexer, top_k: the model's run-time switches.
    indexer_types: per-layer selection reuse (ModelConfig.indexer_types: a list of "full" /
      "shared", a pattern "FFSS...", or {index_topk_freq, index_skip_topk_offset}); shared
      layers skip their indexer and its key cache. None: the model's own.
    coarse_threshold (COARSE_THRESHOLD): fraction of the visible key blocks the hierarchical
      indexer's coarse stage keeps (HierarchicalConfig.coarse_keep_ratio); candidate_tokens:
      the alternative budget in tokens. Set at most one of them.
    coarse: the hierarchical indexer's coarse scorer, "mean" or "learned" (the trained
      coarse screen shipped beside the model; HierarchicalConfig.coarse).
    coarse_mass: the adaptive budget (HierarchicalConfig.coarse_mass): each query keeps the
      fewest best blocks holding this much of the screen's softmax mass; COARSE_THRESHOLD or
      candidate_tokens is then the maximum.
    fine_batch_size (FINE_BATCH_SIZE): queries scored per fine step of the hierarchical indexer.
    cache_size (CACHE_SIZE): prefix-cache entries (blocks of cache_block_tokens prompt tokens);
      cache_bytes: its byte budget; LRU evicts past either. 0 disables the cache.
    max_context: the longest prompt + max_tokens served (clamped to the model's max_seq_len).
    queue_size: the admission limit, running plus waiting requests; past it, 503.
    decode_slots: requests decoded together in one batched step.
    prefill_chunk: prompt tokens prefilled between two decode steps (None: the model's).
    batching_window_ms: how long an idle engine waits for more requests to fill a batch.
    request_timeout_s: a request still running after this gets 504 and its work stops.
    drain_timeout_s: how long SIGTERM waits for in-flight requests before exiting anyway.
    gpu_utilization (GPU_UTILIZATION): fraction of device memory JAX may take.
    warmup_max_context: compile prefill and decode buckets up to this length before ready
      (None: max_context; 0: no warm-up).
    api_key: when set, /v1/* and /predict need `Authorization: Bearer <api_key>`.
    fp8_experts: an FP8 DeepSeek-V3.2 / GLM-5 folder's routed experts stay in FP8 e4m3
      with their block scales (half of bf16's bytes: what lets V3.2 fit 8 x H200).
    host_timeout_s: several processes: a process of the group that sends no heartbeat for
      this long is lost (serving.hosts; a step may take longer: the heartbeat is not a step).
    heartbeat_port: several processes: process 0's heartbeat port (None: the coordinator's
      port + 1).
    shadow_rate: share of prefill chunks whose selection is checked against flat (shadow
      recall, serving.shadow); None: 0 when the deployed selection is flat, else
      DEFAULT_SHADOW_RATE. shadow_rows: query rows checked per watched chunk.
      shadow_max_seconds_per_s: the most shadow work per second of wall time (a budget;
      chunks are skipped past it).
    canary: None, or a CanaryConfig mapping: a second selection configuration of the same
      weights that a share of new requests runs (serving.rollout).
    admin_key: the Bearer token of /admin/* (None: api_key; with neither, /admin/* is off).
    """

    model: str = "default"
    model_version: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    attention: str | None = None
    indexer: str | None = None
    top_k: int | None = None
    indexer_types: object = None
    coarse_threshold: float | None = None
    candidate_tokens: int | None = None
    coarse: str | None = None
    coarse_mass: float | None = None
    fine_batch_size: int | None = None
    cache_size: int = 4096
    cache_bytes: int = 2 << 30
    cache_block_tokens: int = 256
    max_context: int = 32768
    queue_size: int = 64
    decode_slots: int = 4
    prefill_chunk: int | None = None
    batching_window_ms: float = 2.0
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 600.0
    gpu_utilization: float = 0.9
    warmup_max_context: int | None = None
    api_key: str | None = None
    fp8_experts: bool = False
    host_timeout_s: float = 10.0
    heartbeat_port: int | None = None
    shadow_rate: float | None = None
    shadow_rows: int = 16
    shadow_max_seconds_per_s: float = 0.05
    canary: object = None
    admin_key: str | None = None

    def __post_init__(self):
        _check(self, "serving config: ")
        if isinstance(self.canary, dict):
            object.__setattr__(self, "canary", CanaryConfig.from_mapping(self.canary))
        elif self.canary is not None and not isinstance(self.canary, CanaryConfig):
            raise ValueError(f"serving config: canary must be null or a mapping (indexer, "
                             f"share, model_version, ...), got {self.canary!r}")

    def shadow_rate_for(self, model_config):
        """The shadow rate this config runs for a model of `model_config`'s selection."""
        return _shadow_rate(self.shadow_rate, model_config)

    def model_overrides(self):
        """The model's run-time switches this config sets (ModelConfig fields)."""
        out = _selection_overrides(self)
        if self.prefill_chunk is not None:
            out["prefill_chunk"] = self.prefill_chunk
        return out


def _shadow_rate(rate, model_config):
    if rate is not None:
        return float(rate)
    if model_config.attention != "sparse" or model_config.indexer == "flat":
        return 0.0
    return DEFAULT_SHADOW_RATE


def _selection_overrides(cfg):
    out = {name: getattr(cfg, name) for name in ("attention", "indexer", "top_k",
                                                 "indexer_types")
           if getattr(cfg, name) is not None}
    hierarchical = {}
    if cfg.coarse_threshold is not None:
        hierarchical.update(coarse_keep_ratio=cfg.coarse_threshold, candidate_tokens=None)
    if cfg.candidate_tokens is not None:
        hierarchical.update(candidate_tokens=cfg.candidate_tokens, coarse_keep_ratio=None)
    if cfg.fine_batch_size is not None:
        hierarchical["fine_batch_size"] = cfg.fine_batch_size
    for name in ("coarse", "coarse_mass"):
        if getattr(cfg, name) is not None:
            hierarchical[name] = getattr(cfg, name)
    if hierarchical:
        out["hierarchical"] = hierarchical
    return out


def _check(self, where):
    """Validates the fields `self` has (a ServingConfig or a CanaryConfig); errors start
    with `where` and name the key and its allowed range."""
    names = {f.name for f in dataclasses.fields(self)}

    def fail(name, allowed):
        raise ValueError(f"{where}{name} must be {allowed}, got {getattr(self, name)!r}")

    def check_int(name, lo, hi=1 << 40, optional=False):
        value = getattr(self, name, None)
        if name not in names or (optional and value is None):
            return
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            fail(name, f"{'null or ' if optional else ''}an integer in [{lo}, {hi}]")

    def check_number(name, lo, hi, *, lo_open=False, optional=False):
        value = getattr(self, name, None)
        if name not in names or (optional and value is None):
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not (lo < value if lo_open else lo <= value) or value > hi:
            fail(name, f"{'null or ' if optional else ''}a number in "
                       f"{'(' if lo_open else '['}{lo:g}, {hi:g}]")

    for name in ("model", "host"):
        if name in names and (not isinstance(getattr(self, name), str)
                              or not getattr(self, name)):
            fail(name, "a non-empty string")
    if "fp8_experts" in names and not isinstance(self.fp8_experts, bool):
        fail("fp8_experts", "true or false")
    for name in ("model_version", "api_key", "admin_key"):
        value = getattr(self, name, None)
        if value is not None and (not isinstance(value, str) or not value):
            fail(name, "null or a non-empty string")
    if self.attention is not None and self.attention not in ATTENTION_KINDS:
        fail("attention", f"null or one of {ATTENTION_KINDS}")
    served = selection_names(served=True)
    if self.indexer is not None and self.indexer not in served:
        fail("indexer", f"null or one of {served}")
    if self.indexer_types is not None:
        # The spelling only: its length is checked against the model when it loads.
        try:
            normalize_indexer_types(self.indexer_types, None)
        except ValueError as e:
            raise ValueError(f"{where}{e}".replace("ModelConfig.", "")) from None
    check_int("port", 0, 65535)
    check_int("top_k", 1, optional=True)
    check_number("coarse_threshold", 0.0, 1.0, lo_open=True, optional=True)
    check_int("candidate_tokens", 1, optional=True)
    if self.coarse_threshold is not None and self.candidate_tokens is not None:
        raise ValueError(f"{where}set at most one of coarse_threshold (COARSE_THRESHOLD) and "
                         "candidate_tokens, got both")
    if self.coarse is not None and self.coarse not in COARSE_KINDS:
        fail("coarse", f"null or one of {COARSE_KINDS}")
    check_number("coarse_mass", 0.0, 1.0, lo_open=True, optional=True)
    check_int("fine_batch_size", 1, optional=True)
    check_int("cache_size", 0)
    check_int("cache_bytes", 0)
    check_int("cache_block_tokens", 1, 65536)
    check_int("max_context", 16)
    check_int("queue_size", 1)
    check_int("decode_slots", 1, 1024, optional="share" in names)
    check_int("prefill_chunk", 1, optional=True)
    check_number("batching_window_ms", 0.0, 10_000.0)
    check_number("request_timeout_s", 0.0, 86_400.0, lo_open=True)
    check_number("drain_timeout_s", 0.0, 86_400.0)
    check_number("gpu_utilization", 0.0, 1.0, lo_open=True)
    check_int("warmup_max_context", 0, optional=True)
    check_number("host_timeout_s", 0.0, 3600.0, lo_open=True)
    check_int("heartbeat_port", 1, 65535, optional=True)
    check_number("shadow_rate", 0.0, 1.0, optional=True)
    check_int("shadow_rows", 1, 4096)
    check_number("shadow_max_seconds_per_s", 0.0, 1.0, lo_open=True)
    check_number("share", 0.0, 1.0)
    check_number("recall_floor", 0.0, 1.0, lo_open=True, optional=True)
    check_int("guard_window", 1, 100_000)


@dataclasses.dataclass(frozen=True)
class CanaryConfig(FrozenConfig):
    """The `canary:` block: a second selection configuration of the same weights.

    share: the fraction of new requests routed to it (a stable hash of X-Request-Id or
      `user`; serving.rollout). model_version: its label on every metric (None: the
      baseline's + "-canary"). attention ... fine_batch_size: the model switches of the
      main config (SELECTION_SWITCHES), applied on top of the baseline's. shadow_rate: its
      own shadow rate (None: the rule of the main config's, for the canary's selection).
    decode_slots: its own decode slots (None: the main config's; each side holds its own).
    recall_floor, guard_window: the guard (off when recall_floor is None): the canary is
      rolled back by itself when the mean shadow recall of its last guard_window watched
      chunks is below recall_floor.
    """

    share: float = 0.1
    model_version: str | None = None
    attention: str | None = None
    indexer: str | None = None
    top_k: int | None = None
    indexer_types: object = None
    coarse_threshold: float | None = None
    candidate_tokens: int | None = None
    coarse: str | None = None
    coarse_mass: float | None = None
    fine_batch_size: int | None = None
    shadow_rate: float | None = None
    decode_slots: int | None = None
    recall_floor: float | None = None
    guard_window: int = 20

    def __post_init__(self):
        _check(self, "serving config: canary.")

    @classmethod
    def from_mapping(cls, data):
        try:
            return cls.from_dict(_lower_keys(data))
        except ValueError as e:
            message = str(e)
            if not message.startswith("serving config"):
                message = f"serving config: canary: {message}"
            raise ValueError(message) from None

    def model_overrides(self):
        """The model switches the canary sets on top of the baseline's."""
        return _selection_overrides(self)

    def shadow_rate_for(self, model_config):
        return _shadow_rate(self.shadow_rate, model_config)


def _lower_keys(data):
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"serving config must be a mapping of keys to values, "
                         f"got {type(data).__name__}")
    lowered = {}
    for key, value in data.items():
        name = str(key).lower()
        if name in lowered:
            raise ValueError(f"serving config: key {name!r} is given twice (keys are "
                             "case-insensitive)")
        lowered[name] = value
    return lowered


def config_from_mapping(data, **overrides):
    """ServingConfig from a mapping whose keys may use any case (COARSE_THRESHOLD), then
    `overrides` (None values are skipped)."""
    values = _lower_keys(data)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ServingConfig.from_dict(values)


def load_config(path=None, **overrides):
    """ServingConfig from a YAML file (default serving/configs/default.yaml), then
    `overrides` (None values are skipped). ValueError names the file and the bad key."""
    path = pathlib.Path(path) if path is not None else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read serving config {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"serving config {path} is not valid YAML: {e}") from e
    try:
        return config_from_mapping(data, **overrides)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
