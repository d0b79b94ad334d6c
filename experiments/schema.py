"""Typed YAML configs of the experiment scripts: frozen, validated sections built on
indexer.config.FrozenConfig (unknown keys rejected by name at every level), errors that name
the entry's dotted path, value checks, `--set key.path=value` overrides, and the model
section shared by the trainer and the main job."""

import dataclasses
import typing

import yaml

from indexer.config import FrozenConfig
from model.config import ModelConfig
from model.presets import PRESETS

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


class ConfigError(ValueError):
    """A rejected entry: str() is its dotted path, then the reason. A section re-raises the
    errors of the sections inside it under their field's name (`within`)."""

    def __init__(self, path, reason):
        self.path, self.reason = path, reason
        super().__init__(f"{path} {reason}" if path else reason)

    def within(self, name):
        return ConfigError(f"{name}.{self.path}" if self.path else f"{name}:", self.reason)


def _section_type(annotation):
    """The FrozenConfig class a field holds (`X` or `X | None`), else None."""
    options = typing.get_args(annotation) or (annotation,)
    kinds = [k for k in options if isinstance(k, type) and issubclass(k, FrozenConfig)]
    return kinds[0] if len(kinds) == 1 else None


class ConfigSection(FrozenConfig):
    """FrozenConfig.from_dict (unknown keys rejected by name), with the path of the entry
    in its errors, optional nested sections (`X | None`) built from dicts, and a section
    written empty in the YAML (None) taking its default."""

    @classmethod
    def from_dict(cls, data):
        if isinstance(data, dict):
            data = dict(data)
            for field in dataclasses.fields(cls):
                kind = _section_type(field.type)
                if kind is None or field.name not in data:
                    continue
                if data[field.name] is None:
                    del data[field.name]
                elif isinstance(data[field.name], dict):
                    try:
                        data[field.name] = kind.from_dict(data[field.name])
                    except ConfigError as e:
                        raise e.within(field.name) from None
        try:
            return super().from_dict(data)
        except ConfigError:
            raise
        except ValueError as e:  # FrozenConfig.from_dict: unknown keys, not a mapping
            raise ConfigError("", str(e)) from None


def fail(name, allowed, value):
    raise ConfigError(name, f"must be {allowed}, got {value!r}")


def check_int(section, name, lo, *, optional=False):
    value = getattr(section, name)
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        fail(name, f"{'None or ' if optional else ''}an int >= {lo}", value)


def check_number(section, name, allowed, ok):
    """A float field: ok(value) must hold; ints and numeric strings become floats."""
    value = getattr(section, name)
    number = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None or not ok(number):
        fail(name, f"a number {allowed}", value)
    object.__setattr__(section, name, number)


def check_bool(section, name):
    if not isinstance(getattr(section, name), bool):
        fail(name, "true or false", getattr(section, name))


@dataclasses.dataclass(frozen=True)
class ModelSection(ConfigSection):
    """preset: a model.config preset (None: "small"; must stay None with init_from).
    overrides: ModelConfig fields set on the preset, or on the init_from checkpoint's
    config (their values are checked by ModelConfig when the trainer builds it)."""

    preset: str | None = None
    overrides: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.preset is not None and self.preset not in PRESETS:
            fail("preset", f"None or one of {sorted(PRESETS)}", self.preset)
        overrides = {} if self.overrides is None else self.overrides
        if not isinstance(overrides, dict):
            fail("overrides", "a mapping of ModelConfig fields", overrides)
        unknown = sorted(set(overrides) - set(MODEL_FIELDS))
        if unknown:
            raise ConfigError("overrides:", f"unknown ModelConfig fields {unknown}; allowed: "
                                            f"{sorted(MODEL_FIELDS)}")
        object.__setattr__(self, "overrides", dict(overrides))


def apply_overrides(raw, overrides):
    """Set each "key.path=value" of `overrides` in the dict `raw` (value parsed as YAML),
    creating sections on the way; -> raw."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key.path=value, got {item!r}")
        key, value = item.split("=", 1)
        node = raw
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ValueError(f"--set {key}: {'.'.join(parts[:depth + 1])} is "
                                 f"{node[part]!r}, not a section")
            node = node[part]
        node[parts[-1]] = yaml.safe_load(value)
    return raw




def read_yaml(path, overrides=()):
    """The YAML mapping at `path` with the `--set` overrides applied (a plain dict)."""
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    return apply_overrides(raw, overrides)
