"""One YAML load path for every memplan file: dataclass <-> plain data, strictly.

``yaml.safe_load`` only; unknown keys are rejected with the sorted list of known ones; a
missing required field or a value of the wrong type names its dotted path. Profile and Plan
both go through here, so the rules are the same everywhere."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from memplan.errors import ProfileError
from memplan.suggest import did_you_mean

T = TypeVar("T")


def to_data(obj: Any) -> Any:
    """A dataclass tree as plain dicts, lists and scalars (field order kept)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_data(item) for item in obj]
    if isinstance(obj, dict):
        return {str(key): to_data(value) for key, value in obj.items()}
    if isinstance(obj, float) and obj.is_integer() and abs(obj) < 2**53:
        return obj  # keep floats floats; YAML round-trips them
    return obj


# libyaml's C loader and dumper when PyYAML was built with it (about 10× faster on a
# 200-layer profile); both are the "safe" variants, with the same resolver and types.
SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SAFE_DUMPER: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

LARGEST_INT = 2**62
"""Larger integers are not bytes, counts or sizes of anything real (4.6 EB)."""
LARGEST_FLOAT = 1e30
"""Larger numbers are not seconds, FLOPs or bytes of anything real."""


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` with the C loader when present."""
    return yaml.load(text, Loader=SAFE_LOADER)  # a SafeLoader: no arbitrary objects


def dump_yaml(obj: Any) -> str:
    data = to_data(obj)
    options = {"sort_keys": False, "default_flow_style": None, "width": 100}
    try:
        return yaml.dump(data, Dumper=SAFE_DUMPER, **options)
    except UnicodeEncodeError:  # libyaml cannot take a lone surrogate; PyYAML escapes it
        return yaml.dump(data, Dumper=yaml.SafeDumper, **options)


TOP_LEVEL = "(top level)"
"""``from_data(..., path=TOP_LEVEL)``: the file itself is ``cls``, so its fields are named
bare (``checks[0].budget``), and a problem with the whole mapping names ``(top level)``."""


def from_data(cls: type[T], data: Any, *, source: str, path: str = "") -> T:
    """Build ``cls`` from plain data, checking every key and type; errors name
    ``source`` (the file) and the dotted field path."""
    return _convert(cls, data, source=source, path=path or cls.__name__)


def _short(value: Any) -> str:
    """``repr(value)`` cut to 40 characters (a 400-digit number is not worth printing)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _child(path: str, name: object) -> str:
    return str(name) if path == TOP_LEVEL else f"{path}.{name}"


def _fail(source: str, path: str, problem: str, hint: str | None = None) -> ProfileError:
    return ProfileError(f"{source}: field '{path}' {problem}.", hint=hint)


def _convert(tp: Any, data: Any, *, source: str, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, data, source=source, path=path)
            except ProfileError as exc:
                errors.append(exc)
        raise errors[0] if errors else _fail(source, path, "must not be null")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if data not in allowed:
            raise _fail(
                source, path, f"is {data!r}, expected one of {', '.join(map(repr, allowed))}"
            )
        return data
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, (list, tuple)):
            raise _fail(source, path, f"must be a list, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(
                _convert(args[0], item, source=source, path=f"{path}[{i}]")
                for i, item in enumerate(data)
            )
        if len(args) != len(data):
            raise _fail(source, path, f"must have {len(args)} items, got {len(data)}")
        return tuple(
            _convert(a, item, source=source, path=f"{path}[{i}]")
            for i, (a, item) in enumerate(zip(args, data, strict=True))
        )
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(data, dict):
            raise _fail(source, path, f"must be a mapping, got {type(data).__name__}")
        return {
            _convert(key_tp, k, source=source, path=path): _convert(
                value_tp, v, source=source, path=_child(path, k)
            )
            for k, v in data.items()
        }
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, data, source=source, path=path)
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise _fail(source, path, f"must be a number, got {_short(data)}")
        if isinstance(data, float) and not math.isfinite(data):
            raise _fail(source, path, f"is {data}, not a finite number")
        if abs(data) > LARGEST_FLOAT:
            raise _fail(source, path, f"is {_short(data)}, absurdly large (over {LARGEST_FLOAT:g})")
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            if isinstance(data, float) and data.is_integer():
                data = int(data)
            else:
                raise _fail(source, path, f"must be an integer, got {_short(data)}")
        if abs(data) > LARGEST_INT:
            raise _fail(source, path, f"is {_short(data)}, absurdly large (over 2**62)")
        return data
    if tp is bool:
        if not isinstance(data, bool):
            raise _fail(source, path, f"must be true or false, got {data!r}")
        return data
    if tp is str:
        if not isinstance(data, str):
            raise _fail(source, path, f"must be a string, got {data!r}")
        return data
    raise TypeError(f"schema: unsupported field type {tp!r} at {path}")  # a bug in memplan


@functools.cache
def _fields_of(cls: Any) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """Resolved type hints and init fields of a dataclass, once per class (resolving the
    hints is most of the cost of reading a 200-layer profile otherwise)."""
    hints = typing.get_type_hints(cls)
    return hints, {f.name: f for f in dataclasses.fields(cls) if f.init}


def _convert_dataclass(cls: Any, data: Any, *, source: str, path: str) -> Any:
    if not isinstance(data, dict):
        raise _fail(source, path, f"must be a mapping, got {type(data).__name__}")
    hints, fields = _fields_of(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        hint = f"Known keys: {', '.join(sorted(fields))}."
        if maybe := did_you_mean(map(str, unknown), list(fields), n=1):
            hint = f"{maybe} {hint}"
        raise _fail(source, path, f"has unknown key(s) {', '.join(map(str, unknown))}", hint)
    kwargs = {}
    for name, field in fields.items():
        if name not in data:
            if (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            ):
                raise _fail(source, _child(path, name), "is missing")
            continue
        kwargs[name] = _convert(hints[name], data[name], source=source, path=_child(path, name))
    try:
        return cls(**kwargs)
    except ValueError as exc:  # __post_init__ validation names the field
        raise _fail(source, path, f"is invalid: {exc}") from None


def load_yaml_file(path: str | Path, *, what: str) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load``; any problem is a ProfileError naming the file."""
    file = Path(path)
    if not file.is_file():
        raise ProfileError(f"{what} file {file} does not exist.", hint="Check the path.")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(
            f"Cannot read {what} file {file}: {exc.strerror or exc}.", hint="Check its permissions."
        ) from None
    except UnicodeDecodeError:
        text = None
    try:
        if text is None:
            raise ValueError("not UTF-8 text")
        data = safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ProfileError(
            f"{file} is not valid YAML ({first}).",
            hint=f"The file may be corrupted; write the {what} again.",
        ) from None
    if not isinstance(data, dict):
        raise ProfileError(
            f"{file} does not hold a memplan {what} (expected a mapping at the top)."
        )
    return data
