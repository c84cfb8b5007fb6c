"""The CLI's words in a script's terms: an error raised while ``plan_model`` (or any
in-script entry point) runs names the keyword argument the script passes, not the command
line's flag.

The probe and the solver say what to do in flags ("choose others with --layers GLOB",
"--margin 0"), because most of their callers are the commands. A script calling
``plan_model(layers=...)`` has no ``--layers``; before, it was told to use one. ``in_script``
rewrites every ``--flag`` that names one of the entry point's keywords (``--layers GLOB`` →
``layers=GLOB``, ``--compiled`` → ``compiled=True``, ``--tp 2`` →
``layout=LayoutRequest(tp=2)``, ``--seq-len`` with no value it can read → ``seq_len``) in
the error's message and hint, and leaves the others
(``--debug``) as they are. No torch.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from typing import Any, TypeVar

from memplan.errors import MemplanError

__all__ = ["in_script", "script_terms"]

_F = TypeVar("_F", bound=Callable[..., Any])

_FLAG = re.compile(
    r"(?<![\w-])--(?P<no>no-)?(?P<name>[a-z][a-z0-9]*(?:-[a-z0-9]+)*)"
    r"(?:[ =](?P<value>'[^']*'|\"[^\"]*\"|[A-Z][A-Z_]*\b|\d[\w.%]*?)(?=[.,;:)]?(?:\s|$)))?"
)
"""A long flag, with the value written after it when that is a quoted text, an upper-case
placeholder (GLOB, NAME) or a number or size (0, 24GiB, 80%); a sentence's stop after the
value stays outside it."""

_RENAMED = {"format": "formats"}
"""Flags whose keyword is not their name with underscores."""

_DONE = "_memplan_in_script"
"""Set on an error once rewritten, so nested entry points leave it alone."""


def script_terms(text: str, keywords: Iterable[str], flags: Iterable[str] = ()) -> str:
    """``text`` with each ``--flag`` that is one of ``keywords`` written as the keyword
    argument; ``flags``: the keywords that are switches (``--compiled`` → ``compiled=True``,
    ``--no-x`` → ``x=False``). Flags for the layout's degrees and schedule become
    ``layout=LayoutRequest(...)``."""
    known = set(keywords)
    switches = set(flags)
    layout = {f.name for f in fields(_layout_request())} if "layout" in known else set()

    def word(match: re.Match[str]) -> str:
        name = match["name"].replace("-", "_")
        name = _RENAMED.get(name, name)
        value = match["value"]
        if value is None and name in switches | layout:
            value = "False" if match["no"] else "True"
        shown = f"{name}={_literal(value)}" if value is not None else name
        if name in layout:
            return f"layout=LayoutRequest({shown})"
        if name in known:
            return shown
        return match[0]

    return _FLAG.sub(word, text)


def in_script(forwarded: Callable[[], Mapping[str, inspect.Parameter]]) -> Callable[[_F], _F]:
    """Decorate an in-script entry point so that a ``MemplanError`` leaving it names its
    keyword arguments for the flags; ``forwarded()``: the parameters its ``**request`` takes
    (``memplan solve``'s request), asked for when an error is rewritten."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except MemplanError as exc:
                if not getattr(exc, _DONE, False):
                    _rewrite(exc, *keywords_of(fn, forwarded))
                raise

        return wrapper  # type: ignore[return-value]

    return decorate


def keywords_of(
    fn: Callable[..., Any], forwarded: Callable[[], Mapping[str, inspect.Parameter]]
) -> tuple[frozenset[str], frozenset[str]]:
    """The keyword arguments a script can pass ``fn`` (its own and, for ``**request``,
    ``forwarded()``'s), and which of them are switches."""
    params = dict(inspect.signature(fn).parameters)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        params.update(forwarded())
    named = {n: p for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
    switches = {n for n, p in named.items() if isinstance(p.default, bool)}
    return frozenset(named), frozenset(switches)


def _rewrite(exc: MemplanError, keywords: frozenset[str], switches: frozenset[str]) -> None:
    exc.message = script_terms(exc.message, keywords, switches)
    if exc.hint:
        exc.hint = script_terms(exc.hint, keywords, switches)
    exc.args = (exc.message, *exc.args[1:])
    setattr(exc, _DONE, True)


def _literal(value: str) -> str:
    """How a flag's value reads as Python: numbers and placeholders as written, a size or
    other text quoted."""
    if value[0] in "'\"" or value.isupper() or value in ("True", "False"):
        return value
    try:
        float(value)
    except ValueError:
        return repr(value)
    return value


def _layout_request() -> Any:
    from memplan.solver.request import LayoutRequest

    return LayoutRequest
