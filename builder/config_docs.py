"""Dataclass field docstrings → help text, and Click options generated from a config dataclass.

Configs are documented once, in the dataclass (a string literal under each field, as in vLLM's
`get_attr_docs`); the CLI reads defaults and help from there instead of copying them by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
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


def _click_type(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return _click_type(args[0])
    return {int: int, float: float, bool: bool, str: str}.get(annotation, str)


def dataclass_options(cls: type, exclude: tuple[str, ...] = (), prefix: str = "") -> Callable:
    """Decorator adding one `--field-name` option per dataclass field (default None = keep the
    dataclass default, so the command can tell what the user set)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)

    def decorate(fn: Callable) -> Callable:
        for f in reversed(dataclasses.fields(cls)):
            if f.name in exclude or not f.init:
                continue
            typ = _click_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else None
            help_text = f"{docs.get(f.name, '')} [default: {default}]"
            name = "--" + prefix + f.name.replace("_", "-")
            if typ is bool:
                flag = f"{name}/--no-{prefix}{f.name.replace('_', '-')}"
                fn = click.option(flag, f.name, default=None, help=help_text)(fn)
            else:
                fn = click.option(name, f.name, type=typ, default=None, help=help_text)(fn)
        return fn

    return decorate


def pick(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that are fields of `cls` and were set (not None)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names and v is not None}
