"""Structured output on a tiny real engine (random weights, the demo checkpoint's real byte-level
tokenizer, xgrammar): whatever the weights want, every JSON Schema output parses (strict JSON) and
validates with `jsonschema`, every regex output fullmatches; free requests sharing the batch get
exactly the tokens they get alone; a bad grammar fails its own request only; max_tokens before the
grammar is complete is "length"; preemption (recompute) keeps each matcher consistent."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch
from click.testing import CliRunner

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.cli.main import main
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.frontend.schemas import choice_grammar
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.serving.engine import LLMEngine
from trtforge.serving.sampler import Sampler, SamplingState
from trtforge.serving.structured_output import GrammarCompiler

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MAX_SEQ_LEN = 256
PROMPTS = ["Hello world", "The quick brown fox", "Return JSON:", "Once upon a time", "{", "x y z"]

# Every size is bounded (string lengths, item counts, number ranges) so that a random model always
# completes within max_tokens: an unbounded string is a legal way to run out of tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "score", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                },
            },
            "required": ["id", "address"],
        },
        "items": {
            "type": "array", "minItems": 1, "maxItems": 2,
            "items": {"type": "object",
                      "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                     "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                      "required": ["sku", "qty"]},
        },
        "paid": {"type": "boolean"},
    },
    "required": ["user", "items", "paid"],
}
EVENTS = {
    "type": "array", "minItems": 1, "maxItems": 3,
    "items": {"type": "object",
              "properties": {"ok": {"type": "boolean"},
                             "code": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
                             "level": {"enum": ["low", "high"]}},
              "required": ["ok", "code", "level"]},
}
SCHEMAS = {"person": PERSON, "order": ORDER, "events": EVENTS}
REGEXES = [r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(yes|no|maybe)",
           r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}\."]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    ckpt = make_checkpoint(tmp / "ckpt", arch="qwen2")
    out, _ = build_engine(str(ckpt), tmp / "engine",
                          BuildConfig(dtype="float32", max_batch_size=64, max_num_tokens=512,
                                      max_seq_len=MAX_SEQ_LEN, kv_block_size=4, kv_cache_memory="8MiB"),
                          progress=False)
    return out


@pytest.fixture(scope="module")
def engine(engine_dir) -> LLMEngine:
    return LLMEngine.from_engine_dir(engine_dir)


def guided(kind: str, guide: str | None, **kw) -> SamplingParams:
    return SamplingParams(guided_decoding_guide_type=kind, guided_decoding_guide=guide, **kw)


def run_all(engine: LLMEngine) -> dict:
    """Step until idle; the final output of every request."""
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_every_json_schema_output_parses_and_validates(engine, temperature):
    cases = [(name, i) for name in SCHEMAS for i in range(6)]
    params = [guided("json_schema", json.dumps(SCHEMAS[name]), max_tokens=200, temperature=temperature,
                     seed=100 + i) for name, i in cases]
    outs = engine.generate([PROMPTS[i] for _, i in cases], params)
    for (name, i), out in zip(cases, outs):
        assert out.finish_reason == "stop", f"{name}/{i}: {out.finish_reason} {out.error} {out.text!r}"
        doc = json.loads(out.text)  # strict: no raw control characters inside strings
        jsonschema.validate(doc, SCHEMAS[name])
    if temperature > 0:
        assert len({o.text for o in outs}) > len(SCHEMAS), "sampling gave the same documents everywhere"


def test_every_regex_output_fullmatches(engine):
    cases = [(rx, t, s) for rx in REGEXES for t in (0.0, 0.8, 1.5) for s in range(3)]
    outs = engine.generate([PROMPTS[s] for _, _, s in cases],
                           [guided("regex", rx, max_tokens=64, temperature=t, seed=s) for rx, t, s in cases])
    for (rx, t, s), out in zip(cases, outs):
        assert out.finish_reason == "stop", (rx, t, s, out.finish_reason, out.error, out.text)
        assert re.fullmatch(rx, out.text), (rx, out.text)


def test_json_object_ebnf_and_ignore_eos_end_with_the_grammar(engine):
    """`json` gives a JSON object; an EBNF grammar is followed; with ignore_eos the request still
    ends when the grammar has ended (it cannot continue)."""
    grammar = 'root ::= "answer: " ("red" | "green" | "blue") "!"'
    outs = engine.generate(PROMPTS[:3] * 3, [guided("json", None, max_tokens=120, temperature=0.8, seed=s)
                                             for s in range(3)]
                           + [guided("ebnf_grammar", grammar, max_tokens=20, temperature=1.0, seed=s)
                              for s in range(3)]
                           + [guided("regex", "(yes|no)", max_tokens=20, ignore_eos=True, min_tokens=10)
                              for _ in range(3)])
    for out in outs[:3]:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    for out in outs[3:6]:
        assert re.fullmatch(r"answer: (red|green|blue)!", out.text), out.text
    for out in outs[6:]:
        assert out.finish_reason == "stop" and out.text in ("yes", "no"), (out.finish_reason, out.text)


def test_a_choice_grammar_gives_exactly_one_of_the_choices(engine):
    """The OpenAI endpoint's `structured_outputs.choice` (frontend/schemas.py) compiles as an EBNF
    alternation whose literals keep quotes, backslashes, newlines and non-ASCII text."""
    choices = ["yes", 'say "no"', "back\\slash", "two\nlines", "café"]
    grammar = choice_grammar(choices)
    outs = engine.generate(PROMPTS * 2, [guided("ebnf_grammar", grammar, max_tokens=20, temperature=1.5, seed=s)
                                         for s in range(2 * len(PROMPTS))])
    assert all(o.finish_reason == "stop" and o.text in choices for o in outs), [o.text for o in outs]
    assert len({o.text for o in outs}) > 1


def test_free_requests_in_a_mixed_batch_get_the_tokens_they_get_alone(engine_dir):
    free = [SamplingParams(max_tokens=24, ignore_eos=True), SamplingParams(max_tokens=24, temperature=0.9, seed=7),
            SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3)]
    alone = [LLMEngine.from_engine_dir(engine_dir).generate([PROMPTS[i]], p)[0].output_token_ids
             for i, p in enumerate(free)]
    engine = LLMEngine.from_engine_dir(engine_dir)
    constrained = [guided("json_schema", json.dumps(PERSON), max_tokens=200, temperature=t, seed=3)
                   for t in (0.0, 1.0)] + [guided("regex", REGEXES[0], max_tokens=64)]
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[4], PROMPTS[2], PROMPTS[5]]
    mixed = engine.generate(prompts, [free[0], constrained[0], free[1], constrained[1], free[2], constrained[2]])
    assert [o.output_token_ids for o in mixed[0::2]] == alone
    for out in mixed[1:4:2]:
        jsonschema.validate(json.loads(out.text), PERSON)
    assert re.fullmatch(REGEXES[0], mixed[5].text)


@pytest.mark.parametrize("kind, guide, words", [
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", json.dumps({"type": "nonsense"}), "cannot be compiled"),
    ("regex", "[a-", "cannot be compiled"),
    ("ebnf_grammar", "root ::= ", "cannot be compiled"),
])
def test_a_bad_grammar_fails_its_request_alone(engine_dir, kind, guide, words):
    engine = LLMEngine.from_engine_dir(engine_dir)
    good = [engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True)),
            engine.add_request(PROMPTS[1], guided("regex", REGEXES[1], max_tokens=30, temperature=1.0, seed=1))]
    engine.step()
    with pytest.raises(ValueError, match=words) as err:
        engine.add_request(PROMPTS[2], guided(kind, guide, max_tokens=30))
    assert "guided_decoding_guide" in str(err.value) and "/project/cpp" not in str(err.value)
    final = run_all(engine)
    assert set(final) == set(good)
    assert final[good[0]].finish_reason == "length" and len(final[good[0]].output_token_ids) == 12
    assert final[good[1]].finish_reason == "stop" and re.fullmatch(REGEXES[1], final[good[1]].text)
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("fields, words", [
    ({"guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"}, "guided_decoding_guide_type='xml'"),
    ({"guided_decoding_guide_type": "json_schema"}, "guided_decoding_guide is missing"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a" * (64 * 1024 + 1)}, "at most 65536"),
    ({"guided_decoding_guide": "[a-z]+"}, "without guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": "json", "guided_decoding_guide": "{}"}, "takes no guide"),
])
def test_admission_refuses_a_malformed_guide(engine, fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.add_request("x", SamplingParams(**fields))
    assert not engine.has_unfinished()


def test_max_tokens_before_the_grammar_is_complete_is_length(engine):
    (out,) = engine.generate(["x"], guided("json_schema", json.dumps(ORDER), max_tokens=12))
    assert out.finish_reason == "length" and len(out.output_token_ids) == 12
    assert out.text.startswith('{"user": {'), out.text  # the schema's start: an unfinished document
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def kv_bytes(engine_dir, blocks: int) -> int:
    cfg = LLMEngine.from_engine_dir(engine_dir).engine_config
    return blocks * kv_bytes_per_token(cfg.model, cfg.dtype) * cfg.block_size


def test_preempted_constrained_requests_resume_consistently(engine_dir):
    """A KV pool too small for the batch forces preemption (recompute); each matcher keeps the
    state of the kept output tokens: the documents are valid and the same as on a roomy engine."""
    params = [guided("json_schema", json.dumps(SCHEMAS[name]), max_tokens=200, seed=s, temperature=t)
              for name in SCHEMAS for s, t in ((1, 0.0), (2, 0.8))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    roomy = LLMEngine.from_engine_dir(engine_dir).generate(prompts, params)
    cramped = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(kv_cache_memory=kv_bytes(engine_dir, 64)),
                                        enable_prefix_caching=True)
    busy = cramped.generate(prompts, [dataclasses.replace(p) for p in params])
    assert cramped.stats().num_preemptions > 0, "the KV pool was meant to force preemption"
    for p, a, b in zip(params, roomy, busy):
        assert b.finish_reason == "stop", (b.finish_reason, b.error)
        jsonschema.validate(json.loads(b.text), json.loads(p.guided_decoding_guide))
        assert a.output_token_ids == b.output_token_ids


def test_grammars_are_cached_by_type_and_guide_in_a_bounded_lru(engine):
    compiler = GrammarCompiler(engine.tokenizer, engine.engine_config.model.vocab_size, engine._eos, cache_size=2)
    first = compiler.compile("regex", "a+")
    assert compiler.compile("regex", "a+") is first and (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile("ebnf_grammar", 'root ::= "a+"')  # same text, other type: another grammar
    compiler.compile("json", None)
    assert compiler.misses == 3 and len(compiler._cache) == 2
    assert compiler.compile("regex", "a+") is not first  # the least recently used was dropped


def test_structural_tags_compile_in_both_forms(engine):
    """xgrammar's structural tag, and the older form TensorRT-LLM documents; a malformed one is
    refused at admission like any guide that does not compile."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tags = [{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<fn>"], "tags": [
                {"begin": "<fn>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</fn>"}]}},
            {"structures": [{"begin": "<fn>", "schema": schema, "end": "</fn>"}], "triggers": ["<fn>"]}]
    for tag in tags:
        (out,) = engine.generate(["x"], guided("structural_tag", json.dumps(tag), max_tokens=8))
        assert out.finish_reason in ("stop", "length") and out.error is None
    for bad, words in (({"structures": [{"begin": "<fn>"}], "triggers": []}, '"begin", "schema" and "end"'),
                       ({"type": "structural_tag"}, "cannot be compiled"), ("<fn>", "not JSON")):
        with pytest.raises(ValueError, match=words):
            engine.add_request("x", guided("structural_tag", json.dumps(bad) if isinstance(bad, dict) else bad))


def test_a_token_the_grammar_forbids_fails_the_request_and_unguided_states_are_refused(engine):
    grammar = engine.grammar_compiler().matcher(guided("regex", "(yes|no)"))
    yes = engine.tokenizer.encode("yes", add_special_tokens=False)
    z = engine.tokenizer.encode("z", add_special_tokens=False)
    with pytest.raises(ValueError, match="not allowed by the request's regex grammar"):
        grammar.accept(z[0])
    grammar.replay(yes)
    grammar.accept(engine._eos[0])
    assert grammar.is_terminated
    # A state that claims a guide but skipped the engine's compilation fails alone in the sampler.
    vocab = engine.engine_config.model.vocab_size
    states = [SamplingState(guided("regex", "a"), [1]), SamplingState(SamplingParams(), [1])]
    out = Sampler().sample(torch.randn(2, vocab), states)
    assert set(out.errors) == {0} and "compiled" in out.errors[0] and out.token_ids[1] >= 0


def test_generate_command_takes_structured_output_flags(engine_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(PERSON))
    runner = CliRunner()
    result = runner.invoke(main, ["generate", str(engine_dir), "--prompt", "a", "--prompt", "b", "--json",
                                  "--json-schema", str(schema), "--max-tokens", "200", "--temperature", "0.7"])
    assert result.exit_code == 0, result.output
    for line in result.output.strip().splitlines():
        row = json.loads(line)
        assert row["finish_reason"] == "stop"
        jsonschema.validate(json.loads(row["text"]), PERSON)
    result = runner.invoke(main, ["generate", str(engine_dir), "--prompt", "a", "--json", "--regex", REGEXES[1],
                                  "--max-tokens", "40"])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(REGEXES[1], json.loads(result.output)["text"])
    result = runner.invoke(main, ["generate", str(engine_dir), "--prompt", "a", "--regex", "[a-"])
    assert result.exit_code == 1 and "cannot be compiled" in result.output
    result = runner.invoke(main, ["generate", str(engine_dir), "--prompt", "a", "--regex", "a", "--json-object"])
    assert result.exit_code == 2 and "at most one of" in result.output
