"""YAML text for plain data (dicts, lists, strings, numbers, booleans, None), written
directly: PyYAML's representer builds a node per value in Python, 100 s for the 2 million
values of a 10,000-layer profile; this writes the same document in a few seconds.

The layout is PyYAML's ``default_flow_style=None``: a list or mapping whose items are all
scalars is written inline (``[1488.0, 16.0]``, ``{intercept: 0.0, slope: 16.0}``), any
other as a block. Scalars are written as PyYAML's safe dumper would read them back: floats
by ``repr`` (``1.0e+16``, ``.inf``, ``.nan``), strings plain when nothing could read them as
another type, else double-quoted with ASCII escapes only. ``yaml.safe_load`` of the text
gives the data back (tests/test_fast_yaml.py checks it for arbitrary data).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import yaml

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_WORDS = {"yes", "no", "true", "false", "on", "off", "null", "y", "n"}


def _quote(text: str) -> str:
    if text.isascii() and text.isprintable():
        return json.dumps(text)  # escapes only " and \
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def scalar(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value).lower()
        if "." not in text and "e" in text:  # 1e+16 reads as a string in YAML 1.1
            text = text.replace("e", ".0e", 1)
        return text
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _WORDS:
            return value
        return _quote(value)
    raise TypeError(f"fast_yaml writes plain data, not {type(value).__name__}")


def _inline(value: Any) -> str:
    """The value on one line: YAML flow style that is also JSON when every string is
    ASCII and every float finite (what ``load`` reads fast)."""
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{_key_text(k, flow=True)}: {_inline(v)}" for k, v in value.items())
            + "}"
        )
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_inline, value)) + "]"
    if isinstance(value, str):
        return _json_str(value)
    return scalar(value)


def _json_str(text: Any) -> str:
    return _quote(str(text))


class _LongKey(Exception):
    pass


def _key_text(key: Any, *, flow: bool = False) -> str:
    """Plain in a block (``name:``), quoted in a flow mapping (``{"name": ...}``: JSON)."""
    text = scalar(key) if isinstance(key, str) and not flow else _json_str(key)
    if len(text) > 1000:  # YAML's limit on a simple key is 1024 characters
        raise _LongKey
    return text


INLINE_CHARS = 100
"""A mapping or list value whose line would be longer is written as a block."""


def _block(value: Any, indent: str, out: list[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            head = f"{indent}{_key_text(key)}:"
            line = _inline(item)
            if isinstance(item, dict | list | tuple) and item and len(line) > INLINE_CHARS:
                out.append(head)
                _block(item, indent + "  ", out)
            else:
                out.append(f"{head} {line}")
        return
    out.extend(f"{indent}- {_inline(item)}" for item in value)


def dump(data: Any) -> str:
    """``data`` as a YAML document (see the module doc)."""
    try:
        return _dump(data)
    except _LongKey:  # PyYAML writes such a key as a complex key
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def _dump(data: Any) -> str:
    if isinstance(data, dict | list | tuple) and data:
        out: list[str] = []
        _block(data, "", out)
        return "\n".join(out) + "\n"
    return _inline(data) + "\n"


# ------------------------------------------------------------------------------ reading
class NotFast(ValueError):
    """The text is not in the layout ``dump`` writes: read it with PyYAML instead."""


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"-?[0-9]+\.[0-9]*(?:e[-+][0-9]+)?")


def _value(token: str, plain_numbers: bool = False, escapes_checked: bool = False) -> Any:
    """A scalar or flow value as ``yaml.safe_load`` reads it, or NotFast when JSON and
    YAML might read it differently. ``plain_numbers``: the text holds no number JSON and
    YAML read differently (``_ODD_NUMBER``), so JSON's own float parsing stands;
    ``escapes_checked``: the whole text holds no escape the two read differently."""
    if not token:
        raise NotFast("empty value")
    first = token[0]
    if not escapes_checked and (_SURROGATE.search(token) or "\\/" in token):
        raise NotFast("an escape JSON and YAML read differently")
    if first in "[{":
        try:
            value = (_JSON_PLAIN if plain_numbers else _JSON_YAML).decode(token)
        except ValueError as exc:
            raise NotFast(str(exc)) from None
        return value
    if first == '"':
        try:
            text = json.loads(token)
        except ValueError as exc:
            raise NotFast(str(exc)) from None
        if not isinstance(text, str) or any(0xD800 <= ord(c) <= 0xDFFF for c in text):
            raise NotFast("a surrogate")
        return text
    if token in ("null", "true", "false"):
        return {"null": None, "true": True, "false": False}[token]
    if _INT.fullmatch(token):
        return int(token)
    if _FLOAT.fullmatch(token):
        return float(token)
    if _PLAIN.fullmatch(token) and token.lower() not in _WORDS:
        return token
    raise NotFast(f"scalar {token[:20]!r}")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A flow mapping's keys, each once (memplan's loader refuses a repeated key)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise NotFast("a repeated key")
    return out


def _refuse(name: str) -> Any:
    raise NotFast(name)


_ODD_NUMBER = re.compile(r"[\[,: \r]-?[0-9]+(?:[eE]|\.[0-9]+(?:E|e(?![-+])))")
"""Where a JSON float ``_FLOAT`` refuses could be: an exponent after a mantissa with no
point, with a capital E or with no sign, on a number after what can precede one in a flow
value (``[``, ``,``, ``:``, or JSON whitespace other than the tab and newline a line
cannot hold). Where it finds none, every float in the text is one ``_yaml_float`` accepts
(a string that matches only costs speed)."""


def _yaml_float(text: str) -> float:
    # JSON's 1e5 or 1.5E5 is a string or a float to YAML 1.1 by rules of its own
    if not _FLOAT.fullmatch(text):
        raise NotFast(f"number {text}")
    return float(text)


_JSON_YAML = json.JSONDecoder(
    parse_constant=_refuse, parse_float=_yaml_float, object_pairs_hook=_unique
)
_JSON_PLAIN = json.JSONDecoder(parse_constant=_refuse, parse_float=float, object_pairs_hook=_unique)
"""Flow values' readers, made once (``json.loads`` with arguments makes one per call)."""


_LINE = re.compile(r"( *)(?:- (.*)|([A-Za-z_][A-Za-z0-9_.\-]*|\"[^\"\\]*\"):(?: (.*))?)")


def load(text: str) -> Any:
    """What ``yaml.safe_load(text)`` returns, for text in the layout ``dump`` writes (read
    with ``json`` a line at a time: 20 times faster); NotFast for any other text."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise NotFast("empty")
    parsed = []
    for line in lines:
        m = _LINE.fullmatch(line)
        if m is None or "\t" in line or " #" in line:
            raise NotFast("a line of another layout")
        parsed.append(m.groups())
    if len(parsed) == 1 and parsed[0][0] == "" and parsed[0][2] is None and parsed[0][1] is None:
        raise NotFast("a bare scalar")
    checked = (_ODD_NUMBER.search(text) is None, not _SURROGATE.search(text) and "\\/" not in text)
    value, end = _read(parsed, 0, "", checked)
    if end != len(parsed):
        raise NotFast("indentation")
    return value


def _key(token: str) -> str:
    if token.startswith('"'):
        key = _value(token)
    elif token.lower() in _WORDS:
        raise NotFast("a key YAML reads as another type")
    else:
        key = token
    return key


def _read(parsed: list, i: int, indent: str, checked: tuple[bool, bool]) -> tuple[Any, int]:
    if parsed[i][0] != indent:
        raise NotFast("indentation")
    if parsed[i][1] is not None:  # a block list
        items = []
        while i < len(parsed) and parsed[i][0] == indent and parsed[i][1] is not None:
            items.append(_value(parsed[i][1], *checked))
            i += 1
        return items, i
    mapping: dict[str, Any] = {}
    while i < len(parsed) and parsed[i][0] == indent and parsed[i][2] is not None:
        _, _, key_token, rest = parsed[i]
        key = _key(key_token)
        if key in mapping:
            raise NotFast("a repeated key")
        if rest is None:
            if i + 1 >= len(parsed) or len(parsed[i + 1][0]) <= len(indent):
                raise NotFast("an empty value")
            mapping[key], i = _read(parsed, i + 1, parsed[i + 1][0], checked)
        else:
            mapping[key] = _value(rest, *checked)
            i += 1
    return mapping, i
