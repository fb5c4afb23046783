"""SamplingParams: defaults, validation messages, bad-word resolution with a real tokenizer."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers.tokenizers import byte_level_tokenizer
from trtforge.config.sampling import SamplingParams


def test_defaults_are_valid_greedy():
    params = SamplingParams().validate()
    assert params.is_greedy and not params.has_penalties
    assert params.max_tokens == 16 and params.logprobs is None and params.stop == []


def test_every_field_is_documented():
    import ast
    import inspect

    from trtforge.config import sampling as sampling_params

    tree = ast.parse(inspect.getsource(sampling_params))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    documented = {
        a.target.id for a, b in zip(cls.body, cls.body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_k", -2), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1),
    ("min_p", 1.1), ("seed", -1), ("seed", 1 << 64), ("seed", 1.0),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 17), ("logprobs", -1),
    ("stop_token_ids", [1, -2]), ("stop", "###"), ("stop", [""]), ("bad_words", [3]),
    ("bad_words_ids", [[]]), ("bad_words_ids", [[1, "a"]]), ("top_k", True),
])
def test_validate_names_field_and_value(field, value):
    params = dataclasses.replace(SamplingParams(), **{field: value})
    with pytest.raises(ValueError) as err:
        params.validate()
    message = str(err.value)
    assert f"SamplingParams.{field}={value!r}" in message and "must be" in message


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.7), ("top_k", -1), ("top_k", 40), ("top_p", 1.0), ("min_p", 0.05),
    ("seed", (1 << 64) - 1), ("seed", 0), ("min_tokens", 16), ("logprobs", 0), ("logprobs", 5),
    ("stop", ["\n\n", "User:"]), ("bad_words_ids", [[3, 4]]),
])
def test_validate_accepts_edge_values(field, value):
    dataclasses.replace(SamplingParams(), **{field: value}).validate()


def test_resolve_bad_words_with_and_without_leading_space():
    tok = byte_level_tokenizer()
    params = SamplingParams(bad_words=["world", "中文"]).resolve_bad_words(tok)
    expected = [tok.encode(w, add_special_tokens=False) for w in ["world", " world", "中文", " 中文"]]
    assert sorted(params.bad_words_ids) == sorted(expected)
    assert any(len(ids) > 1 for ids in params.bad_words_ids)  # multi-token words are kept whole
    params.resolve_bad_words(tok)  # idempotent
    assert sorted(params.bad_words_ids) == sorted(expected)
    params.validate()
