"""The one option-text converter (parse_text) and the Click options made from a dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import click
import pytest
from click.testing import CliRunner

from trtforge.config.fields import base_type, dataclass_options, parse_text, pick


class Refused(ValueError):
    pass


def test_base_type_reads_optional_literal_and_unions():
    assert base_type(int | None) == (int, True)
    assert base_type(float) == (float, False)
    assert base_type(Literal["a", "b"]) == (str, False)
    assert base_type(int | str) == (str, False)  # several types: text, and None is not allowed
    assert base_type(list[int]) == (str, False)


@pytest.mark.parametrize("text,value", [("true", True), ("ON", True), (" yes ", True), ("1", True),
                                        ("false", False), ("Off", False), ("no", False), ("0", False)])
def test_booleans(text, value):
    assert parse_text("flag", text, bool) is value


@pytest.mark.parametrize("text,value", [("4", 4), (" 4 ", 4), ("4.0", 4), ("-2", -2), ("1e3", 1000)])
def test_ints_take_whole_numbers_written_as_floats(text, value):
    got = parse_text("n", text, int)
    assert got == value and type(got) is int


def test_optional_fields_read_empty_and_none_as_none():
    for text in ("", "none", "None", " null "):
        assert parse_text("n", text, int | None) is None
    assert parse_text("n", "7", int | None) == 7
    assert parse_text("x", "0.25", float) == 0.25
    assert parse_text("s", "fcfs", str) == "fcfs"


@pytest.mark.parametrize("text,hint,expected", [
    ("4.5", int, "expected int"), ("sixty", int, "expected int"), ("", int, "expected int"),
    ("none", int, "expected int"), ("inf", int, "expected int"), ("x", int | None, "expected int or none"),
    ("maybe", bool, "expected bool (true/false, 1/0, yes/no, on/off)"), ("fast", float, "expected float"),
])
def test_errors_name_the_option_the_value_and_the_type(text, hint, expected):
    with pytest.raises(Refused) as err:
        parse_text("opt", text, hint, Refused)
    assert str(err.value) == f"opt={text!r} is invalid: {expected}"


@dataclass
class _Opts:
    count: int = 3
    """How many."""
    ratio: float | None = None
    """A fraction."""
    mode: str = "a"
    """a or b."""
    verbose: bool = False
    """Say more."""


def _command(**kwargs):
    @click.command()
    @dataclass_options(_Opts, **kwargs)
    def cmd(**options):
        click.echo(repr(sorted(pick(_Opts, options).items())))

    return cmd


def test_cli_options_convert_with_parse_text():
    result = CliRunner().invoke(_command(), ["--count", "4.0", "--ratio", "0.5", "--verbose"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "[('count', 4), ('ratio', 0.5), ('verbose', True)]"
    bad = CliRunner().invoke(_command(), ["--count", "4.5"])
    assert bad.exit_code == 2 and "count='4.5' is invalid: expected int" in bad.output


def test_cli_choices_are_refused_by_click():
    cmd = _command(choices={"mode": ("a", "b")})
    assert CliRunner().invoke(cmd, ["--mode", "b"]).output.strip() == "[('mode', 'b')]"
    bad = CliRunner().invoke(cmd, ["--mode", "c"])
    assert bad.exit_code == 2 and "'c' is not one of 'a', 'b'" in bad.output


def test_cli_help_shows_the_dataclass_default_or_the_given_text():
    plain = " ".join(CliRunner().invoke(_command(), ["--help"]).output.split())
    assert "How many. [default: 3]" in plain and "--count INTEGER" in plain
    noted = " ".join(CliRunner().invoke(_command(default_text="the engine's, else {default}"),
                                        ["--help"]).output.split())
    assert "How many. [default: the engine's, else 3]" in noted and "[default: 3]" not in noted
