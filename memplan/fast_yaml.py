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


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, dict | list | tuple)


def _inline(value: Any) -> str | None:
    """The value on one line, or None when it needs a block."""
    if isinstance(value, dict):
        if all(_is_scalar(v) for v in value.values()):
            return "{" + ", ".join(f"{scalar(k)}: {scalar(v)}" for k, v in value.items()) + "}"
        return None
    if isinstance(value, list | tuple):
        if all(_is_scalar(v) for v in value):
            return "[" + ", ".join(map(scalar, value)) + "]"
        return None
    return scalar(value)


def _block(value: Any, indent: str, out: list[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            line = _inline(item)
            if line is not None:
                out.append(f"{indent}{scalar(key)}: {line}")
            else:
                out.append(f"{indent}{scalar(key)}:")
                _block(item, indent + "  ", out)
        return
    for item in value:  # a list with a collection among its items
        line = _inline(item)
        if line is not None:
            out.append(f"{indent}- {line}")
        elif isinstance(item, dict):
            inner: list[str] = []
            _block(item, indent + "  ", inner)
            inner[0] = f"{indent}- {inner[0][len(indent) + 2 :]}"
            out.extend(inner)
        else:
            out.append(f"{indent}-")
            _block(item, indent + "  ", out)


def dump(data: Any) -> str:
    """``data`` as a YAML document (see the module doc)."""
    line = _inline(data)
    if line is not None:
        return line + "\n"
    out: list[str] = []
    _block(data, "", out)
    return "\n".join(out) + "\n"
