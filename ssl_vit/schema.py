"""The rules of a config schema: `checked` fields with ranges, one validation pass, and `ConfigError`, the error
every bad value becomes. The schemas themselves live with what they configure (ssl_vit.config for the model,
optimiser, trainer and evaluation; each dataset kind with its data; each objective with its method); this module
imports none of them, so every floor can use it.
"""

from __future__ import annotations

import difflib
from dataclasses import field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A bad configuration value, reported at start-up with the valid choices."""


def checked(default: Any = MISSING, *, factory=None, ge=None, gt=None, le=None, lt=None, length=None,
            choices=None, example: str | None = None):
    """A dataclass field with rules that `validate_config` enforces: bounds apply to a number or to every item of a
    list, `length` to a list, `choices` (the library's own tuple of valid names: stated once) to a string or every
    item of a list; None always passes (optional fields). `example` completes the message when a mandatory value is
    missing."""
    rules = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, length=length, example=example).items()
             if v is not None}
    if choices is not None:
        rules["choices"] = tuple(choices)
    if factory is not None:
        return field(default_factory=factory, metadata=rules)
    return field(default=default, metadata=rules)


_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def not_one_of(key: str, value, choices) -> str:
    """The one message of a value outside its choices: the key, the value, the valid choices, the closest."""
    valid = [str(choice) for choice in choices]
    close = difflib.get_close_matches(str(value), valid, n=2, cutoff=0.6)
    return (f"{key}={value} is not one of {', '.join(valid)}"
            + (f"; did you mean {' or '.join(f'{key}={c}' for c in close)}?" if close else ""))


def _rule_violation(value, rules: dict) -> str | None:
    """What `value` breaks of `rules` ("must be >= 1", "must have 3 values"), or None."""
    if value is None:
        return None
    allowed = " and ".join(f"{symbol} {rules[key]}" for key, (symbol, _) in _BOUNDS.items() if key in rules)
    if isinstance(value, list | tuple | ListConfig):
        if "length" in rules and len(value) != rules["length"]:
            return f"must have {rules['length']} values, got {len(value)}"
        bad = [v for v in value if not all(test(v, rules[k]) for k, (_, test) in _BOUNDS.items() if k in rules)]
        return f"every value must be {allowed}" if bad else None
    if not all(test(value, rules[key]) for key, (_, test) in _BOUNDS.items() if key in rules):
        return f"must be {allowed}"
    return None


def validate_config(cfg, prefix: str = "") -> None:
    """One pass over a composed config (or one node of it, whose keys are reported under `prefix`): every mandatory
    value is set, every `checked` rule holds. Raises ConfigError naming the key, the value and what is allowed."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        example = _field_rules(cfg, key).get("example")
        data_name = cfg.data.get("name") if not prefix and "data" in cfg else None
        raise ConfigError(f"{prefix}{key} is not set" + (f" (data={data_name})" if key.startswith("data.") else "")
                          + f"; give it on the command line, e.g. {example or prefix + key + '=...'}")
    _check_node(cfg, prefix)


def _field_rules(cfg, dotted_key: str) -> dict:
    parent_key, _, name = dotted_key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    schema = OmegaConf.get_type(parent) if isinstance(parent, DictConfig) else None
    if schema is not None and is_dataclass(schema):
        return dict(next((f.metadata for f in fields(schema) if f.name == name), {}))
    return {}


def closest_names(name: str, valid: list[str], prefix: str) -> str:
    """"; did you mean <prefix><name>?" for the closest valid names, then the valid names (when not too many)."""
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    shown = f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
    return shown + (f" (valid: {', '.join(sorted(valid))})" if valid and len(valid) <= 40 else "")


def _check_node(node: DictConfig, prefix: str) -> None:
    schema = OmegaConf.get_type(node)
    rules = {f.name: f.metadata for f in fields(schema)} if schema is not None and is_dataclass(schema) else {}
    if schema is not None and is_dataclass(schema):  # a key added with +key=... that nothing reads
        unknown = next((str(key) for key in node if key not in rules), None)
        if unknown is not None:
            raise ConfigError(f"unknown key {prefix}{unknown}" + closest_names(unknown, list(rules), prefix))
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _check_node(child, f"{prefix}{key}.")
            continue
        if isinstance(child, ListConfig) and not child._is_none() and not child._is_missing():
            # a list of schemas (objective.teachers): each item's rules
            for index, item in enumerate(child):
                if isinstance(item, DictConfig):
                    _check_node(item, f"{prefix}{key}[{index}].")
        if rules.get(key):
            value = node[key]
            _check_choices(f"{prefix}{key}", value, rules[key].get("choices"))
            problem = _rule_violation(value, rules[key])
            if problem:
                shown = list(value) if isinstance(value, ListConfig) else value
                raise ConfigError(f"{prefix}{key}={shown} is invalid: {problem}")


def _check_choices(key: str, value, choices) -> None:
    if choices is None or value is None:
        return
    for item in (value if isinstance(value, list | tuple | ListConfig) else [value]):
        if item not in choices:
            raise ConfigError(not_one_of(key, item, choices))


def check_fields(instance) -> None:
    """The `checked` rules of a dataclass instance's fields (outside Hydra: a model built in Python), as
    `validate_config` applies them to a composed config; ConfigError naming the field, the value and what is
    allowed."""
    for spec in fields(instance):
        value = getattr(instance, spec.name)
        _check_choices(spec.name, value, spec.metadata.get("choices"))
        problem = _rule_violation(value, spec.metadata)
        if problem:
            raise ConfigError(f"{spec.name}={value} {problem}")


def to_container(cfg) -> dict:
    """A config (or a schema dataclass instance) as plain Python values, resolved, enums as their names: for JSON,
    metadata and trackers."""
    if not isinstance(cfg, DictConfig | ListConfig):
        cfg = OmegaConf.structured(cfg)
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
