"""Dataclass field docstrings → help text, Click options generated from a config dataclass, and
the one conversion of option strings to typed values.

Configs are documented once, in the dataclass (a string literal under each field, as in vLLM's
`get_attr_docs`); the CLI reads defaults and help from there instead of copying them by hand.
Option values written as text — on the command line, as Triton parameters, as `--schedule`
overrides — all go through `parse_text`, so every front accepts the same spellings.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from functools import lru_cache
from typing import Any, Callable

import click


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the docstring literal written right below it} for a dataclass."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_NONE = ("", "none", "null")
_INVALID = object()


def base_type(hint: Any) -> tuple[type, bool]:
    """(the concrete type, whether None is allowed) of a field's type hint: `int | None` ->
    (int, True), `Literal["a", "b"]` -> (str, False); a union of several types, or a hint that is
    not a class, reads as str."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return type(typing.get_args(hint)[0]), False
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        return (base_type(rest[0])[0] if len(rest) == 1 else str), len(rest) < len(args)
    return (hint if isinstance(hint, type) else str), False


def parse_text(name: str, text: str, hint: Any, error: type[ValueError] = ValueError) -> Any:
    """Option `name`'s string value (command line, Triton parameter, engine.json override) as a
    value of its type hint. Booleans: true/false, 1/0, yes/no, on/off; optional fields: "", "none"
    (or "null") is None; ints take "4" and "4.0" but not "4.5".

    Raises `error` naming the option, the value and the type expected."""
    base, optional = base_type(hint)
    raw = text.strip()
    if optional and raw.lower() in _NONE:
        return None
    value = _convert(base, raw)
    if value is _INVALID:
        expected = base.__name__ + (" (true/false, 1/0, yes/no, on/off)" if base is bool else "")
        raise error(f"{name}={text!r} is invalid: expected {expected}{' or none' if optional else ''}")
    return value


def _convert(base: type, raw: str) -> Any:
    if base is bool:
        low = raw.lower()
        return True if low in _TRUE else False if low in _FALSE else _INVALID
    try:
        if base is int:
            try:
                return int(raw)
            except ValueError:  # "4.0": tools and JSON round-trips often write whole numbers so
                number = float(raw)
                return int(number) if number.is_integer() else _INVALID
        return base(raw)
    except (TypeError, ValueError):
        return _INVALID


class _TextOption(click.ParamType):
    """A Click option type reading its text with `parse_text`, so that the command line takes the
    same spellings as Triton parameters and `--schedule` values."""

    def __init__(self, field: str, hint: Any):
        self.field, self.hint = field, hint
        self.name = {int: "integer", float: "float"}.get(base_type(hint)[0], "text")  # the metavar

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return parse_text(self.field, value, self.hint)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _option_type(field: str, hint: Any, choices: tuple[str, ...] | None) -> Any:
    if choices is not None:
        return click.Choice(choices)
    # Text stays Click's plain string (kept verbatim); numbers take parse_text's spellings.
    return str if base_type(hint)[0] is str else _TextOption(field, hint)


def dataclass_options(cls: type, exclude: tuple[str, ...] = (), prefix: str = "",
                      choices: dict[str, tuple[str, ...]] | None = None,
                      default_text: str | None = None, only: tuple[str, ...] | None = None,
                      dest_prefix: str = "") -> Callable:
    """Decorator adding one `--field-name` option per dataclass field (default None = keep the
    dataclass default, so the command can tell what the user set).

    only: just these fields. prefix: the flags' prefix (`--{prefix}field-name`); dest_prefix: the
    prefix of the parameter names the command receives (to take one field twice, e.g. for the
    context and the generation model).

    choices: {field: allowed values}, offered as a Click choice. default_text: what the help says
    the default is ("{default}" there: the dataclass's), for a command whose defaults come from
    elsewhere first (e.g. an engine's engine.json)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    choices = choices or {}

    def decorate(fn: Callable) -> Callable:
        for f in reversed(dataclasses.fields(cls)):
            if f.name in exclude or not f.init or (only is not None and f.name not in only):
                continue
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = default if default_text is None else default_text.format(default=default)
            help_text = f"{docs.get(f.name, '')} [default: {shown}]"
            name = "--" + prefix + f.name.replace("_", "-")
            if base_type(hints[f.name])[0] is bool:
                flag = f"{name}/--no-{prefix}{f.name.replace('_', '-')}"
                fn = click.option(flag, dest_prefix + f.name, default=None, help=help_text)(fn)
            else:
                typ = _option_type(f.name, hints[f.name], choices.get(f.name))
                fn = click.option(name, dest_prefix + f.name, type=typ, default=None, help=help_text)(fn)
        return fn

    return decorate


def pick(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that are fields of `cls` and were set (not None)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names and v is not None}


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int) -> int:
    """'4GiB' → 4294967296; '512MB' → 512000000; plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size in bytes: write e.g. 4GiB, 512MiB or 2000000000.")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
