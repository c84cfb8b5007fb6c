"""One YAML load path for every memplan file: dataclass <-> plain data, strictly.

``yaml.safe_load`` only; unknown keys are rejected with the sorted list of known ones; a
missing required field or a value of the wrong type names its dotted path. Profile and Plan
both go through here, so the rules are the same everywhere."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import types
import typing
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from memplan.errors import ProfileError, unreadable_output
from memplan.files import fast_yaml
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


class NoAliasDumper(SAFE_DUMPER):  # type: ignore[misc,valid-type]
    """The safe dumper writing a value that occurs twice out twice: memplan's loader
    refuses anchors and aliases (``safe_load``)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class _PyNoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


LARGEST_INT = 2**62
"""Larger integers are not bytes, counts or sizes of anything real (4.6 EB)."""
LARGEST_FLOAT = 1e30
"""Larger numbers are not seconds, FLOPs or bytes of anything real."""


class RefusedYAML(yaml.YAMLError):
    """YAML that parses but that memplan refuses: an anchor or alias, a duplicate key, a
    key that is not a plain value. ``str()`` says what and on which line."""


class _Strict:
    """The safe loader, refusing duplicate keys and keys that are not scalars (the YAML
    spec says keys are unique; PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        self.flatten_mapping(node)
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise RefusedYAML(f"line {line}: a key that is a list or mapping")
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise RefusedYAML(f"line {line}: duplicate key {_short(key_node.value)}")
            seen.add(key)
        mapping = super().construct_mapping(node, deep=deep)
        if len(mapping) != len(node.value):  # e.g. `yes` and `true`: one bool, twice
            raise RefusedYAML(f"line {node.start_mark.line + 1}: duplicate keys in one mapping")
        return mapping


class _StrictLoader(_Strict, SAFE_LOADER):  # type: ignore[misc,valid-type]
    pass


class _PyStrictLoader(_Strict, yaml.SafeLoader):
    """The same in PyYAML's own parser: libyaml refuses a lone surrogate's escape
    (``"\\uD800"``) that the YAML spec allows and PyYAML's dumpers write."""


def _refuse_anchors(text: str, loader: Any = SAFE_LOADER) -> None:
    """Raise RefusedYAML at the first anchor (``&a``) or alias (``*a``) in ``text``. memplan's
    files never need them, and aliases nest into exponentially large values (an "alias
    bomb": 1 KB of YAML, gigabytes of lists). Only the parser's events are read, so this
    is linear in the text however the aliases nest."""
    if "&" not in text and "*" not in text:  # neither can occur without its character
        return
    for event in yaml.parse(text, Loader=loader):
        what = (
            "an alias"
            if isinstance(event, yaml.AliasEvent)
            else "an anchor"
            if getattr(event, "anchor", None) is not None
            else None
        )
        if what is not None:
            raise RefusedYAML(
                f"line {event.start_mark.line + 1}: {what} "
                f"({'*' if what == 'an alias' else '&'}{_short(event.anchor)[1:-1]})"
            )


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` (the C loader when present), strictly: anchors, aliases, duplicate
    keys and non-scalar keys raise ``RefusedYAML`` (a ``yaml.YAMLError``). Text in
    memplan.files.fast_yaml's layout (a profile memplan wrote) is read a line at a time with
    ``json``, to the same data (it has no anchors, and a duplicate key sends it here)."""
    try:
        return fast_yaml.load(text)
    except fast_yaml.NotFast:
        pass
    try:
        _refuse_anchors(text)
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no arbitrary objects
    except RefusedYAML:
        raise
    except yaml.YAMLError:
        if SAFE_LOADER is yaml.SafeLoader:
            raise
    # libyaml refused it: PyYAML's own parser decides (its errors are the same kinds)
    _refuse_anchors(text, yaml.SafeLoader)
    return yaml.load(text, Loader=_PyStrictLoader)


def dump_yaml(obj: Any) -> str:
    data = to_data(obj)
    options = {"sort_keys": False, "default_flow_style": None, "width": 100}
    try:
        return yaml.dump(data, Dumper=NoAliasDumper, **options)
    except UnicodeEncodeError:  # libyaml cannot take a lone surrogate; PyYAML escapes it
        return yaml.dump(data, Dumper=_PyNoAliasDumper, **options)


TOP_LEVEL = "(top level)"
"""``from_data(..., path=TOP_LEVEL)``: the file itself is ``cls``, so its fields are named
bare (``checks[0].budget``), and a problem with the whole mapping names ``(top level)``."""


def from_data(cls: type[T], data: Any, *, source: str, path: str = "") -> T:
    """Build ``cls`` from plain data, checking every key and type; errors name
    ``source`` (the file) and the dotted field path."""
    try:
        return _fast(cls)(data)
    except _Slow:  # something to name, or a case the fast reader leaves to the full one
        return _convert(cls, data, source=source, path=path or cls.__name__)


class _Slow(Exception):
    """The fast reader declines: the full one (``_convert``) reads the data again."""


_FAST: dict[Any, Callable[[Any], Any]] = {}


def _fast(tp: Any) -> Callable[[Any], Any]:
    """``_fast_reader(tp)``, once per type."""
    reader = _FAST.get(tp)
    if reader is None:
        reader = _FAST[tp] = _fast_reader(tp)
    return reader


def _fast_reader(tp: Any) -> Callable[[Any], Any]:
    """A reader of ``tp`` from plain data that builds what ``_convert`` would, with no
    field paths (a 10,000-layer profile has a million fields), and raises ``_Slow`` on
    anything it is not sure ``_convert`` reads the same way: every error then comes from
    ``_convert``, with its path."""
    origin, args = _shape(tp)
    if tp is float:
        return _fast_float
    if tp is int:
        return _fast_int
    if tp is bool or tp is str:
        return functools.partial(_fast_exact, tp)
    if tp is Any:
        return lambda data: data
    if origin is Literal:
        return functools.partial(_fast_literal, args)
    if origin in (Union, types.UnionType):
        return functools.partial(
            _fast_union, type(None) in args, [_fast(a) for a in args if a is not type(None)]
        )
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if _shape(args[0]) == (tuple, (float, float)):
            return _fast_points
        return functools.partial(_fast_items, _fast(args[0]))
    if origin is tuple:
        return functools.partial(_fast_tuple, [_fast(a) for a in args])
    if origin is dict:
        return functools.partial(_fast_dict, _fast(args[0]), _fast(args[1]))
    if dataclasses.is_dataclass(tp):
        hints, fields = _fields_of(tp)
        readers: dict[str, Callable[[Any], Any]] = {}
        required = frozenset(
            name
            for name, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        # registered before its fields' readers: a dataclass may hold itself (a tree)
        reader = _FAST[tp] = functools.partial(_fast_dataclass, tp, readers, required)
        readers.update((name, _fast(hints[name])) for name in fields)
        if fields and all(hints[name] is float for name in fields):  # Affine: 140,000 of them
            return functools.partial(_fast_floats, tp, frozenset(fields), required, reader)
        return reader
    return _slow


def _slow(data: Any) -> Any:
    raise _Slow


def _fast_float(data: Any) -> float:
    if type(data) is float and -LARGEST_FLOAT <= data <= LARGEST_FLOAT:  # NaN compares false
        return data
    if type(data) is int and abs(data) <= LARGEST_FLOAT:
        return float(data)
    raise _Slow


def _fast_int(data: Any) -> int:
    if type(data) is int and abs(data) <= LARGEST_INT:
        return data
    raise _Slow


def _fast_exact(tp: type, data: Any) -> Any:
    if type(data) is tp:
        return data
    raise _Slow


def _fast_literal(allowed: tuple, data: Any) -> Any:
    if data in allowed:
        return data
    raise _Slow


def _fast_union(nullable: bool, readers: list[Callable[[Any], Any]], data: Any) -> Any:
    if data is None and nullable:
        return None
    # ``_convert`` takes the first option that reads it: a later one may not stand in
    # for an earlier one that declined
    return readers[0](data) if readers else _slow(data)


def _fast_points(data: Any) -> tuple[tuple[float, float], ...]:
    if type(data) is list and (points := _points(data)) is not None:
        return points
    raise _Slow


def _fast_items(read: Callable[[Any], Any], data: Any) -> tuple:
    if type(data) is list or type(data) is tuple:
        return tuple(map(read, data))
    raise _Slow


def _fast_tuple(readers: list[Callable[[Any], Any]], data: Any) -> tuple:
    if (type(data) is list or type(data) is tuple) and len(data) == len(readers):
        return tuple(read(item) for read, item in zip(readers, data, strict=True))
    raise _Slow


def _fast_dict(key: Callable[[Any], Any], value: Callable[[Any], Any], data: Any) -> dict:
    if type(data) is dict:
        return {key(k): value(v) for k, v in data.items()}
    raise _Slow


def _fast_floats(
    cls: Any, names: frozenset[str], required: frozenset[str], other: Callable, data: Any
) -> Any:
    """A dataclass of float fields, from finite floats: one check per value, no readers;
    anything else goes to ``other`` (the general reader)."""
    if (
        type(data) is dict
        and required <= data.keys() <= names
        and all(type(v) is float and -LARGEST_FLOAT <= v <= LARGEST_FLOAT for v in data.values())
    ):
        try:
            return cls(**data)
        except ValueError:
            raise _Slow from None
    return other(data)


def _fast_dataclass(
    cls: Any, readers: dict[str, Callable[[Any], Any]], required: frozenset[str], data: Any
) -> Any:
    if type(data) is not dict or not required <= data.keys() or not data.keys() <= readers.keys():
        raise _Slow
    try:
        return cls(**{name: readers[name](value) for name, value in data.items()})
    except ValueError:  # __post_init__'s message, with the path
        raise _Slow from None


def _short(value: Any) -> str:
    """``repr(value)`` cut to 40 characters (a 400-digit number is not worth printing, and
    a list is named by its length, never formatted whole)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {value.bit_length() * 30103 // 100000 + 1} digits or so"
    if isinstance(value, list | tuple | dict | set):
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value[:80] if isinstance(value, str) else value)
    return text if len(text) <= 40 else text[:37] + "..."


def _child(path: str, name: object) -> str:
    return str(name) if path == TOP_LEVEL else f"{path}.{name}"


def _fail(source: str, path: str, problem: str, hint: str | None = None) -> ProfileError:
    return ProfileError(f"{source}: field '{path}' {problem}.", hint=hint)


def _as_text(data: Any) -> str | None:
    """The hint for a number YAML read as text: ``8e-1`` and ``1e9`` are strings to YAML
    1.1 (PyYAML), whose exponent form needs a dot and a signed exponent (``8.0e-1``); one
    without an exponent (``"78017756"``) was quoted, and the exponent hint said nothing of
    the quotes."""
    if not isinstance(data, str):
        return None
    try:
        value = float(data.replace("_", ""))
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    if value.is_integer() and abs(value) < 1e18:
        written = str(int(value))
    else:
        plain = repr(value)
        written = plain if "." in plain and "e" not in plain else f"{value:.1e}"
    if "e" not in data.lower():  # YAML reads a plain 32 or 0.8 as a number: it was quoted
        return f"It is the quoted text {data!r}, not a number. Write {written} without quotes."
    return (
        f"YAML reads {data} as text, not a number: its exponent form needs a dot and a "
        f"signed exponent. Write {written}."
    )


@functools.cache
def _shape(tp: Any) -> tuple[Any, tuple]:
    """``typing.get_origin`` and ``get_args`` of a field type, once per type."""
    return typing.get_origin(tp), typing.get_args(tp)


def _convert(tp: Any, data: Any, *, source: str, path: str) -> Any:
    if tp is float and type(data) is float and math.isfinite(data) and abs(data) <= LARGEST_FLOAT:
        return data  # the common case first: a profile holds millions
    origin, args = _shape(tp)
    if origin is tuple and args == (float, float) and type(data) is list and len(data) == 2:
        a, b = data  # a timeline point
        if type(a) is type(b) is float and all(
            math.isfinite(x) and abs(x) <= LARGEST_FLOAT for x in (a, b)
        ):
            return (a, b)
    if tp is Any:
        return data
    if origin in (Union, types.UnionType):
        options = args
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
        allowed = args
        if data not in allowed:
            raise _fail(
                source, path, f"is {_short(data)}, expected one of {', '.join(map(repr, allowed))}"
            )
        return data
    if origin is tuple:
        if not isinstance(data, (list, tuple)):
            raise _fail(source, path, f"must be a list, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            if _shape(args[0]) == (tuple, (float, float)) and (points := _points(data)):
                return points
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
        key_tp, value_tp = args
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
            raise _fail(source, path, f"must be a number, got {_short(data)}", _as_text(data))
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
                raise _fail(source, path, f"must be an integer, got {_short(data)}", _as_text(data))
        if abs(data) > LARGEST_INT:
            raise _fail(source, path, f"is {_short(data)}, absurdly large (over 2**62)")
        return data
    if tp is bool:
        if not isinstance(data, bool):
            raise _fail(source, path, f"must be true or false, got {_short(data)}")
        return data
    if tp is str:
        if not isinstance(data, str):
            raise _fail(source, path, f"must be a string, got {_short(data)}")
        return data
    raise TypeError(f"schema: unsupported field type {tp!r} at {path}")  # a bug in memplan


def _points(data: list | tuple) -> tuple[tuple[float, float], ...] | None:
    """A list of timeline points in one pass when every one is a pair of finite floats (a
    profile of 10,000 layers holds about a million); None sends anything else down the
    item-by-item path, which names the bad one."""
    if not data:
        return ()
    # the checks in C loops (map), not a Python call per point: a million points
    if set(map(type, data)) != {list} or set(map(len, data)) != {2}:
        return None
    values = list(chain.from_iterable(data))
    if (
        set(map(type, values)) == {float}
        and all(map(math.isfinite, values))  # before max and min, which NaN would fool
        and min(values) >= -LARGEST_FLOAT
        and max(values) <= LARGEST_FLOAT
    ):
        return tuple(map(tuple, data))
    return None


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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (and back as it was after): reading
    a 10,000-layer profile builds a million containers, none of them in a cycle, and the
    collector's passes over them took a third of the time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_back(text: str, what: str, read: Callable[[Any], Any]) -> None:
    """Read ``text``, a ``what`` (``profile``/``plan``) memplan made, as its loader reads a
    file (``safe_load``, then ``read``: the schema and the problem rules). A refusal is
    memplan's own failure, never the user's: ``UnreadableOutputError`` (exit 3) naming the
    field, raised before the caller writes anything."""
    try:
        read(safe_load(text))
    except ProfileError as exc:
        problem = exc.message  # "<the profile memplan made>: field ..." less the source
        if problem.startswith("<") and ">" in problem:
            problem = problem.split(">", 1)[1].lstrip(": ")
        raise unreadable_output(what, problem.rstrip(".")) from exc
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise unreadable_output(what, f"its YAML does not read back ({exc})") from exc


MAX_FILE_BYTES = 1 << 30
"""The largest file memplan reads as a profile, plan or config: a profile of 10,000 layers
at every probed size is tens of MB. A 2 GiB sparse file was read whole (15 s, 4 GB of
memory) before it was found not to be YAML."""


def load_yaml_file(path: str | Path, *, what: str) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load``; any problem is a ProfileError naming the file."""
    file = Path(path)
    if file.is_dir():
        raise ProfileError(f"{what} file {file} is a folder.", hint=f"Name the {what} file in it.")
    if not file.exists():
        raise ProfileError(f"{what} file {file} does not exist.", hint="Check the path.")
    if not file.is_file():  # /dev/zero, a named pipe: read whole, or waited on for ever
        raise ProfileError(
            f"{what} file {file} is not a regular file (a device, a pipe or a socket).",
            hint=f"Name the {what} file itself.",
        )
    try:
        size = file.stat().st_size
    except OSError:
        size = 0
    if size > MAX_FILE_BYTES:
        raise ProfileError(
            f"{what} file {file} holds {size:,} bytes, more than any memplan {what} "
            f"({MAX_FILE_BYTES:,} at most): it is not one, or it is damaged.",
            hint="Check the path.",
        )
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
    except RefusedYAML as exc:
        raise ProfileError(
            f"{file}: {exc}; memplan refuses YAML anchors, aliases and duplicate keys.",
            hint=f"Write each value out once, under one key; memplan's {what} files need neither.",
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise ProfileError(
            f"{file} is not valid YAML ({first}).",
            hint=f"The file may be corrupted; write the {what} again.",
        ) from None
    if not isinstance(data, dict):
        raise ProfileError(
            f"{file} does not hold a memplan {what} (expected a mapping at the top)."
        )
    return data
