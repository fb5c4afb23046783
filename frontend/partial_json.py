"""Reading JSON that is still being generated: where a value ends, if it has ended yet.

The tool-call parsers look at a model's output after every streamed delta. They need the *raw
text* of a call's arguments (so that the streamed fragments concatenate to exactly the text a
non-streamed answer returns) and its name as soon as that string is closed, from JSON that may
stop anywhere. These functions scan, they never build the value: `value_end(text, i)` is the
index just past the JSON value that starts at `text[i]`, or None while it is incomplete;
`object_members` walks the members of an object for as far as the text goes.

Invalid JSON is not diagnosed here: a scan that meets something that is not JSON stops with
None (incomplete), and the caller decides with `json.loads` on the final text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

WHITESPACE = " \t\n\r"
_SCALAR_END = ",}]" + WHITESPACE


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Past the closing quote of the string opening at text[i] ('"'); None if not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Past the JSON value starting at text[i] (not whitespace); None while it is incomplete.

    A scalar (number, true, false, null) at the very end of the text counts as incomplete: more
    digits may follow."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c not in "{[":
        j = i
        while j < len(text) and text[j] not in _SCALAR_END:
            j += 1
        return j if j < len(text) and j > i else None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def string_at(text: str, i: int) -> str | None:
    """The decoded JSON string at text[i], once it is closed (None otherwise or if invalid)."""
    if i >= len(text) or text[i] != '"':
        return None
    end = _string_end(text, i)
    if end is None:
        return None
    try:
        value = json.loads(text[i:end])
    except ValueError:
        return None
    return value if isinstance(value, str) else None


@dataclass
class Member:
    """One `"key": value` of an object: where its value starts and ends (end None: not yet)."""

    key: str
    start: int
    end: int | None


def object_members(text: str, i: int) -> tuple[list[Member], int | None]:
    """The members of the object opening at text[i] ('{') as far as the text goes, and the index
    past its closing brace (None while it is open). A member is listed once its value has begun."""
    members: list[Member] = []
    for member in _members(text, i):
        members.append(member)
        if member.end is None:
            return members, None
    j = skip_ws(text, members[-1].end if members else i + 1)
    return members, (j + 1 if j < len(text) and text[j] == "}" else None)


def _members(text: str, i: int) -> Iterator[Member]:
    j = skip_ws(text, i + 1)
    while j < len(text) and text[j] != "}":
        key = string_at(text, j)
        if key is None:
            return
        j = skip_ws(text, _string_end(text, j) or len(text))
        if j >= len(text) or text[j] != ":":
            return
        start = skip_ws(text, j + 1)
        if start >= len(text):
            return
        end = value_end(text, start)
        yield Member(key, start, end)
        if end is None:
            return
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j >= len(text) or text[j] != "}":
            return
