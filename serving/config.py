"""The serving configuration: pydantic models read from YAML.

Keys are case-insensitive, so the reference deployment's spellings (COARSE_THRESHOLD,
FINE_BATCH_SIZE, CACHE_SIZE, GPU_UTILIZATION, TOP_K, ...) load as they are. The selection
switches are one model (`SelectionSwitches`) that ServingConfig and a canary's CanaryConfig
both extend; besides its four fields, each switch a selection kind's settings class offers
(indexer.config.offered: HierarchicalConfig's candidate_tokens, coarse_threshold,
fine_batch_size, coarse, coarse_mass) is a key of the same name. A bad value raises
ValueError naming the key and its allowed range. This module imports no JAX: `python -m
serving` reads it before JAX starts (GPU_UTILIZATION must be in the environment by then).
"""

import pathlib
from typing import Annotated, Any, ClassVar, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from indexer.selection import offered_settings, selection_names, settings_overrides
from model.config import ATTENTION_KINDS, normalize_indexer_types

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "default.yaml"
# shadow_rate when the config leaves it null and the deployed selection is not flat.
DEFAULT_SHADOW_RATE = 0.1
_BIG = 1 << 40
_WHERE = "serving config: "


class _Allowed:
    """Annotated metadata: what a field allows, as its error message says it."""

    def __init__(self, text):
        self.text = text


class _FieldError(ValueError):
    """A value a model validator rejects: field `name` (relative to the model) allows
    `allowed`, got `value`."""

    def __init__(self, name, allowed, value):
        super().__init__(f"{name} must be {allowed}, got {value!r}")
        self.name, self.allowed, self.value = name, allowed, value


def _range(lo, hi, lo_open):
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"


def _int(lo, hi=_BIG, *, optional=False):
    allowed = f"{'null or ' if optional else ''}an integer in [{lo}, {hi}]"
    kind = Annotated[int, Strict(), Field(ge=lo, le=hi)]
    return Annotated[kind | None if optional else kind, _Allowed(allowed)]


def _number(lo, hi, *, lo_open=False, optional=False):
    allowed = f"{'null or ' if optional else ''}a number in {_range(lo, hi, lo_open)}"
    bounds = Field(gt=lo, le=hi) if lo_open else Field(ge=lo, le=hi)
    kind = Annotated[float, Strict(), bounds]
    return Annotated[kind | None if optional else kind, _Allowed(allowed)]


def _text(*, optional=False):
    kind = Annotated[str, Strict(), Field(min_length=1)]
    return Annotated[kind | None if optional else kind,
                     _Allowed(f"{'null or ' if optional else ''}a non-empty string")]


_Flag = Annotated[bool, Strict(), _Allowed("true or false")]


def _offered_allowed(setting):
    """What an offered switch allows (always null too: null keeps the model's value)."""
    how, base = setting.how, base_type(setting.type)
    if how.choices is not None:
        return f"null or one of {tuple(how.choices)}"
    lo = how.gt if how.gt is not None else how.ge
    hi = how.le if how.le is not None else _BIG
    if base is int:
        return f"null or an integer in [{lo if lo is not None else -_BIG}, {hi}]"
    if base is float:
        return f"null or a number in {_range(lo, hi, how.gt is not None)}"
    return f"null or a {getattr(base, '__name__', base)}"


def base_type(annotation):
    """The type of an annotation, without None (int | None -> int)."""
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    return args[0] if args else annotation


def _check_offered(setting, value):
    how, base = setting.how, base_type(setting.type)
    if how.choices is not None:
        ok = value in how.choices
    elif base in (int, float):
        ok = not isinstance(value, bool) and isinstance(value, int if base is int
                                                        else (int, float))
        ok = ok and (how.ge is None or value >= how.ge) and (how.gt is None or value > how.gt) \
            and (how.le is None or value <= how.le)
    else:
        ok = isinstance(value, base)
    if not ok:
        raise _FieldError(setting.name, _offered_allowed(setting), value)


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


def _message(error, model, path):
    """One pydantic error of `model` (whose keys sit under `path`) as dosa says it."""
    parts, fields = list(path), model.model_fields
    info = None
    for item in error["loc"]:
        if fields is None or item not in fields:
            break
        parts.append(item)
        info = fields[item]
        nested = base_type(info.annotation)
        fields = nested.model_fields if isinstance(nested, type) and issubclass(
            nested, BaseModel) else None
    where = ".".join(parts)
    if error["type"] == "value_error":
        cause = error["ctx"]["error"]
        if isinstance(cause, _FieldError):
            name = f"{where}.{cause.name}" if where else cause.name
            return f"{_WHERE}{name} must be {cause.allowed}, got {cause.value!r}"
        text = str(cause)
        return text if text.startswith(_WHERE) else \
            f"{_WHERE}{where + ': ' if where else ''}{text}"
    allowed = next((m.text for m in (info.metadata if info else ()) if isinstance(m, _Allowed)),
                   None)
    if allowed is None:
        return f"{_WHERE}{where}: {error['msg']}"
    return f"{_WHERE}{where} must be {allowed}, got {error['input']!r}"


class _SettingsModel(BaseModel):
    """A frozen settings model: keys in any case; errors as ValueError naming the key and
    its allowed range; `replace`, `from_dict`, `to_dict`."""

    model_config = ConfigDict(frozen=True, extra="allow")
    _path: ClassVar[tuple] = ()

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except pydantic.ValidationError as e:
            raise ValueError("; ".join(_message(err, type(self), self._path)
                                       for err in e.errors())) from None

    @classmethod
    def from_dict(cls, data):
        return cls(**_lower_keys(data))

    def to_dict(self):
        return self.model_dump()

    def replace(self, **changes):
        return type(self)(**{**self.model_dump(), **changes})


class SelectionSwitches(_SettingsModel):
    """The model's run-time selection switches a serving config sets (None keeps the
    model's own value): attention, indexer and top_k; indexer_types (per-layer selection
    reuse, ModelConfig.indexer_types: a list of "full" / "shared", a pattern "FFSS...", or
    {index_topk_freq, index_skip_topk_offset}; shared layers skip their indexer and its key
    cache); and every switch the selection kinds' settings offer, as extra keys (see the
    module docstring): e.g. coarse_threshold (COARSE_THRESHOLD), the fraction of the
    visible key blocks the hierarchical coarse stage keeps, or candidate_tokens, its budget
    in tokens (at most one of them); coarse ("mean" or "learned": the trained coarse
    screen); coarse_mass (the adaptive budget); fine_batch_size (FINE_BATCH_SIZE)."""

    attention: Annotated[str | None, _Allowed(f"null or one of {ATTENTION_KINDS}")] = None
    indexer: str | None = None
    top_k: _int(1, optional=True) = None
    indexer_types: Any = None

    @model_validator(mode="before")
    @classmethod
    def _keys_and_switches(cls, data):
        if not isinstance(data, dict):
            return data  # a model already, or pydantic's type error names the field
        data = _lower_keys(data)
        offered = offered_settings()
        unknown = sorted(set(data) - set(cls.model_fields) - set(offered))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; allowed: "
                             f"{sorted(set(cls.model_fields) | set(offered))}")
        if data.get("attention") is not None and data["attention"] not in ATTENTION_KINDS:
            raise _FieldError("attention", f"null or one of {ATTENTION_KINDS}",
                              data["attention"])
        served = selection_names(served=True)
        if data.get("indexer") is not None and data["indexer"] not in served:
            raise _FieldError("indexer", f"null or one of {served}", data["indexer"])
        if data.get("indexer_types") is not None:
            # The spelling only: its length is checked against the model when it loads.
            try:
                normalize_indexer_types(data["indexer_types"], None)
            except ValueError as e:
                raise ValueError(str(e).replace("ModelConfig.", "")) from None
        for name, setting in offered.items():
            if data.setdefault(name, None) is not None:
                _check_offered(setting, data[name])
        # Two switches of one budget (named in the order given).
        settings_overrides({name: value for name, value in data.items() if name in offered})
        return data

    def model_overrides(self):
        """The ModelConfig fields these switches set: attention, indexer, top_k,
        indexer_types, and per selection kind its settings' changes ({kind: {field: value}},
        serving.loading.apply_overrides)."""
        out = {name: getattr(self, name) for name in SelectionSwitches.model_fields
               if getattr(self, name) is not None}
        extra = self.model_extra or {}
        out.update(settings_overrides({name: extra.get(name) for name in offered_settings()}))
        return out



def _shadow_rate(rate, model_config):
    """The shadow rate a config of shadow_rate `rate` runs for `model_config`'s selection."""
    if rate is not None:
        return float(rate)
    if model_config.attention != "sparse" or model_config.indexer == "flat":
        return 0.0
    return DEFAULT_SHADOW_RATE


class CanaryConfig(SelectionSwitches):
    """The `canary:` block: a second selection configuration of the same weights.

    share: the fraction of new requests routed to it (a stable hash of X-Request-Id or
      `user`; serving.rollout). model_version: its label on every metric (None: the
      baseline's + "-canary"). The selection switches (SelectionSwitches) apply on top of
      the baseline's. shadow_rate: its own shadow rate (None: the rule of the main
      config's, for the canary's selection). decode_slots: its own decode slots (None: the
      main config's; each side holds its own). recall_floor, guard_window: the guard (off
      when recall_floor is None): the canary is rolled back by itself when the mean shadow
      recall of its last guard_window watched chunks is below recall_floor.
    """

    _path: ClassVar[tuple] = ("canary",)

    share: _number(0.0, 1.0) = 0.1
    model_version: _text(optional=True) = None
    shadow_rate: _number(0.0, 1.0, optional=True) = None
    decode_slots: _int(1, 1024, optional=True) = None
    recall_floor: _number(0.0, 1.0, lo_open=True, optional=True) = None
    guard_window: _int(1, 100_000) = 20

    @classmethod
    def from_mapping(cls, data):
        return cls.from_dict(data)

    def shadow_rate_for(self, model_config):
        return _shadow_rate(self.shadow_rate, model_config)


class ServingConfig(SelectionSwitches):
    """What `python -m serving` runs.

    model: "default" (the shipped checkpoint), "tiny" (random, UNTRAINED weights: tests and
      development), a pretrained name (smollm2-135m) or a path (.gguf file, Hugging Face
      folder, dosa checkpoint folder).
    model_version: label on every metric and the id clients send as "model" (None: derived
      from the model).
    The selection switches: SelectionSwitches (attention, indexer, top_k, indexer_types,
      and the kinds' offered settings: coarse_threshold, candidate_tokens, coarse,
      coarse_mass, fine_batch_size).
    cache_size (CACHE_SIZE): prefix-cache entries (blocks of cache_block_tokens prompt tokens);
      cache_bytes: its byte budget; LRU evicts past either. 0 disables the cache.
    max_context: the longest prompt + max_tokens served (clamped to the model's max_seq_len).
    queue_size: the admission limit, running plus waiting requests; past it, 503.
    cache_layout: "paged" (one pool of pages of cache_block_tokens positions, shared by
      every running request: a request holds the pages its prompt + max_tokens need, a
      cached prompt prefix's pages are shared by reference; one device only), "slots"
      (decode_slots caches of max_context positions each, prefix hits copied from host
      memory; the layout of a mesh and of several processes) or "auto" (paged on one
      device, slots on a mesh). docs/serving.md: sizing the pool.
    max_running: paged: the most requests decoded together in one batched step.
    cache_pool_bytes: paged: the pool's bytes (None: gpu_utilization's share of the device
      memory left after the weights where the device reports it, else decode_slots x
      max_context positions: the slot layout's memory).
    decode_slots: slots: requests decoded together in one batched step.
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

    model: _text() = "default"
    model_version: _text(optional=True) = None
    host: _text() = "127.0.0.1"
    port: _int(0, 65535) = 8080
    cache_size: _int(0) = 4096
    cache_bytes: _int(0) = 2 << 30
    cache_block_tokens: _int(1, 65536) = 256
    max_context: _int(16) = 32768
    queue_size: _int(1) = 64
    decode_slots: _int(1, 1024) = 4
    cache_layout: Annotated[Literal["auto", "paged", "slots"],
                            _Allowed("one of 'auto', 'paged', 'slots'")] = "auto"
    max_running: _int(1, 4096) = 64
    cache_pool_bytes: _int(1, optional=True) = None
    prefill_chunk: _int(1, optional=True) = None
    batching_window_ms: _number(0.0, 10_000.0) = 2.0
    request_timeout_s: _number(0.0, 86_400.0, lo_open=True) = 600.0
    drain_timeout_s: _number(0.0, 86_400.0) = 600.0
    gpu_utilization: _number(0.0, 1.0, lo_open=True) = 0.9
    warmup_max_context: _int(0, optional=True) = None
    api_key: _text(optional=True) = None
    fp8_experts: _Flag = False
    host_timeout_s: _number(0.0, 3600.0, lo_open=True) = 10.0
    heartbeat_port: _int(1, 65535, optional=True) = None
    shadow_rate: _number(0.0, 1.0, optional=True) = None
    shadow_rows: _int(1, 4096) = 16
    shadow_max_seconds_per_s: _number(0.0, 1.0, lo_open=True) = 0.05
    canary: Annotated[CanaryConfig | None, _Allowed(
        "null or a mapping (indexer, share, model_version, ...)")] = None
    admin_key: _text(optional=True) = None

    def shadow_rate_for(self, model_config):
        """The shadow rate this config runs for a model of `model_config`'s selection."""
        return _shadow_rate(self.shadow_rate, model_config)

    def model_overrides(self):
        """The model's run-time switches this config sets (ModelConfig fields)."""
        out = super().model_overrides()
        if self.prefill_chunk is not None:
            out["prefill_chunk"] = self.prefill_chunk
        return out


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
