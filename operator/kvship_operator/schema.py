"""A small typed-dataclass layer: one Python definition gives the OpenAPI v3 (structural)
schema of a CRD, defaulting and parsing of a raw ``dict`` into dataclasses, and the
CEL rules (``x-kubernetes-validations``) together with their Python equivalents.

Field names are snake_case in Python and camelCase in the API. Supported field types:
``str``, ``int``, ``bool``, ``Quantity``, ``RawObject`` (kept as-is), ``list[T]``,
``dict[str, str | Quantity]``, nested dataclasses and ``Optional[T]`` of any of these.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, NewType, Optional, Union

Quantity = NewType("Quantity", str)  # a Kubernetes resource quantity ("16Gi", 500m, 2)
RawObject = NewType("RawObject", dict)  # an object passed through untouched (affinity, ...)

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


class SpecError(ValueError):
    """A spec that the API schema or a cross-field rule refuses; ``path`` says where."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: the CEL text the API server evaluates (Kubernetes >= 1.25) and
    the same rule in Python, which the operator evaluates on every cluster version."""

    cel: str
    message: str
    check: Callable[[Any], bool]


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def field(
    default: Any = MISSING,
    *,
    description: str,
    minimum: int | None = None,
    maximum: int | None = None,
    enum: list[Any] | None = None,
    pattern: str | None = None,
    max_length: int | None = None,
    max_items: int | None = None,
    min_length: int | None = None,
) -> Any:
    """A dataclass field carrying its API documentation and bounds. Mutable defaults
    (``{}``/``[]``) are copied per instance."""
    meta = {
        "description": description,
        "minimum": minimum,
        "maximum": maximum,
        "enum": enum,
        "pattern": pattern,
        "maxLength": max_length,
        "maxItems": max_items,
        "minLength": min_length,
    }
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda d=default: _copy(d), metadata=meta)
    if default is MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


# ---------------------------------------------------------------------------------------
# type helpers


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


# ---------------------------------------------------------------------------------------
# OpenAPI schema


def openapi(tp: Any) -> dict[str, Any]:
    """Structural OpenAPI v3 schema for a type (no $ref, no nullable unions)."""
    tp, _ = _unwrap_optional(tp)
    if tp is Quantity:
        return {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    if tp is RawObject:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer", "format": "int32"}
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": "array", "items": openapi(item)}
    if origin is dict:
        key, value = typing.get_args(tp)
        assert key is str
        return {"type": "object", "additionalProperties": openapi(value)}
    if _is_dataclass_type(tp):
        return _object_schema(tp)
    raise TypeError(f"unsupported type in spec: {tp!r}")


def _object_schema(cls: type) -> dict[str, Any]:
    hints = _hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner, optional = _unwrap_optional(tp)
        schema = openapi(inner)
        meta = f.metadata
        if meta.get("description"):
            schema = {"description": meta["description"], **{k: v for k, v in schema.items() if k != "description"}}
        for key in ("minimum", "maximum", "enum", "pattern", "maxLength", "minLength", "maxItems"):
            if meta.get(key) is not None:
                if key in ("maxLength", "minLength", "pattern") and schema.get("type") == "array":
                    schema["items"][key] = meta[key]
                else:
                    schema[key] = meta[key]
        if f.default is not MISSING and f.default is not None:
            schema["default"] = f.default
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            schema["default"] = f.default_factory()  # type: ignore[misc]
        if f.default is MISSING and f.default_factory is MISSING and not optional:  # type: ignore[misc]
            required.append(camel(f.name))
        props[camel(f.name)] = schema
    out: dict[str, Any] = {"type": "object"}
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(cls.__name__ + "("):
        out["description"] = " ".join(doc.split())
    out["properties"] = props
    if required:
        out["required"] = required
    one_of = getattr(cls, "__one_of__", None)
    if one_of:
        out["oneOf"] = [{"required": [camel(n)]} for n in one_of]
    rules: list[Rule] = getattr(cls, "__rules__", [])
    if rules:
        out["x-kubernetes-validations"] = [{"rule": r.cel, "message": r.message} for r in rules]
    return out


# ---------------------------------------------------------------------------------------
# parsing (defaulting + the same bounds the schema states)


def parse(cls: type, data: Any, path: str = "spec") -> Any:
    """Build ``cls`` from an API dict, applying schema defaults and checking bounds and
    cross-field rules. Raises SpecError naming the first offending field."""
    obj = _parse(cls, data, path)
    return obj


def _parse(tp: Any, value: Any, path: str) -> Any:
    tp, _ = _unwrap_optional(tp)
    if tp is Quantity:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SpecError(path, "must be a quantity (e.g. 16Gi)")
        if isinstance(value, str) and not re.match(QUANTITY_PATTERN, value):
            raise SpecError(path, f"{value!r} is not a quantity (e.g. 500m, 16Gi)")
        return Quantity(str(value))
    if tp is RawObject:
        if not isinstance(value, dict):
            raise SpecError(path, "must be an object")
        return RawObject(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, "must be a string")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, "must be a boolean")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, "must be an integer")
        return value
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise SpecError(path, "must be a list")
        return [_parse(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise SpecError(path, "must be an object")
        return {str(k): _parse(vt, v, f"{path}.{k}") for k, v in value.items()}
    if _is_dataclass_type(tp):
        return _parse_object(tp, value, path)
    raise TypeError(f"unsupported type {tp!r}")


def _check_bounds(meta: Any, value: Any, path: str) -> None:
    if value is None:
        return
    if meta.get("enum") is not None and value not in meta["enum"]:
        allowed = ", ".join(repr(v) for v in meta["enum"])
        raise SpecError(path, f"Unsupported value {value!r}: supported values: {allowed}")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise SpecError(path, f"should be greater than or equal to {meta['minimum']}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise SpecError(path, f"should be less than or equal to {meta['maximum']}")
    items = value if isinstance(value, list) else [value]
    if meta.get("maxItems") is not None and isinstance(value, list) and len(value) > meta["maxItems"]:
        raise SpecError(path, f"must have at most {meta['maxItems']} items")
    for i, v in enumerate(items):
        where = f"{path}[{i}]" if isinstance(value, list) else path
        if not isinstance(v, str):
            continue
        if meta.get("maxLength") is not None and len(v) > meta["maxLength"]:
            raise SpecError(where, f"may not be longer than {meta['maxLength']}")
        if meta.get("minLength") is not None and len(v) < meta["minLength"]:
            raise SpecError(where, f"should be at least {meta['minLength']} chars long")
        if meta.get("pattern") is not None and not re.search(meta["pattern"], v):
            raise SpecError(where, f"should match '{meta['pattern']}'")


def _parse_object(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise SpecError(path, "must be an object")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    known = set()
    present = []
    for f in dataclasses.fields(cls):
        key = camel(f.name)
        known.add(key)
        where = f"{path}.{key}"
        if key in value and value[key] is not None:
            present.append(f.name)
            parsed = _parse(hints[f.name], value[key], where)
        elif f.default is not MISSING:
            parsed = f.default
            if _is_dataclass_type(_unwrap_optional(hints[f.name])[0]) and parsed is not None:
                parsed = _parse(hints[f.name], parsed, where)
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            raw = f.default_factory()  # type: ignore[misc]
            parsed = _parse(hints[f.name], raw, where)
        elif _unwrap_optional(hints[f.name])[1]:
            parsed = None
        else:
            raise SpecError(where, "Required value")
        _check_bounds(f.metadata, parsed, where)
        kwargs[f.name] = parsed
    one_of = getattr(cls, "__one_of__", None)
    if one_of:
        n = sum(1 for name in one_of if kwargs.get(name) is not None)
        if n != 1:
            names = ", ".join(camel(x) for x in one_of)
            raise SpecError(path, f"exactly one of {names} must be set")
    obj = cls(**kwargs)
    for rule in getattr(cls, "__rules__", []):
        if not rule.check(obj):
            raise SpecError(path, rule.message)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclasses back to an API dict (camelCase, ``None`` fields left out)."""
    if _is_dataclass_type(type(obj)):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None:
                continue
            out[camel(f.name)] = to_dict(v)
        return out
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def iter_rules(cls: type, path: str = "spec") -> list[tuple[str, type, Rule]]:
    """Every (path, class, Rule) in a spec type tree, for tests and documentation."""
    out = [(path, cls, r) for r in getattr(cls, "__rules__", [])]
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        if typing.get_origin(tp) is list:
            (tp,) = typing.get_args(tp)
            sub = f"{path}.{camel(f.name)}[*]"
        else:
            sub = f"{path}.{camel(f.name)}"
        if _is_dataclass_type(tp):
            out += iter_rules(tp, sub)
    return out


__all__ = [
    "Quantity",
    "RawObject",
    "Rule",
    "SpecError",
    "camel",
    "field",
    "iter_rules",
    "openapi",
    "parse",
    "to_dict",
    "Optional",
]
