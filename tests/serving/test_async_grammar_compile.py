"""Structured-output grammars compile off the engine loop, on a tiny real engine (random weights,
the demo checkpoint's byte-level tokenizer, xgrammar): while a genuinely slow JSON Schema compiles
(800 optional properties: ~0.8 s here against a few ms for the schemas of
test_structured_output.py), a free request keeps decoding; two requests with one schema compile it
once; a grammar that fails after admission fails its request alone; an abort while compiling
leaves no KV and no waiting entry behind."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tests.helpers.checkpoints import make_checkpoint
from tests.serving.test_structured_output import guided, run_all
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def slow_schema(n: int = 800) -> dict:
    """n optional properties, in order: xgrammar's rules for "any subset, in order" grow with the
    square of n (0.3 s at 500, ~0.8 s at 800 on this machine's vocabulary of 512), in 40 KB."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": 0, "maximum": 9}
                                             for i in range(n)},
            "additionalProperties": False}


SLOW = json.dumps(slow_schema(), separators=(",", ":"))
FREE = SamplingParams(max_tokens=150, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_grammar")
    ckpt = make_checkpoint(tmp / "ckpt", arch="qwen2")
    out, _ = build_engine(str(ckpt), tmp / "engine",
                          BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=256,
                                      max_seq_len=256, kv_block_size=4, kv_cache_memory="4MiB"),
                          progress=False)
    return out


def schema_params(schema: str = SLOW, **kw) -> SamplingParams:
    return guided("json_schema", schema, max_tokens=kw.pop("max_tokens", 80), **kw)


def assert_valid(out, schema: str = SLOW) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
    jsonschema.validate(json.loads(out.text), json.loads(schema))


def test_a_free_request_decodes_while_a_slow_grammar_compiles(engine_dir):
    engine = LLMEngine.from_engine_dir(engine_dir)
    free = engine.add_request("Hello world", FREE)
    engine.step()  # the free request is running
    engine.grammar_compiler()  # built once per engine (xgrammar reads the vocabulary): not timed here
    start = time.monotonic()
    constrained = engine.add_request("Return JSON:", schema_params())
    admitted_in = time.monotonic() - start
    free_tokens_before, first_token_at, final = 0, None, {}
    while engine.has_unfinished():
        outs = engine.step()
        mine = [o for o in outs if o.request_id == constrained and o.new_token_ids]
        if first_token_at is None and mine:
            first_token_at = time.monotonic() - start
        elif first_token_at is None:  # steps strictly before the constrained request's first token
            free_tokens_before += sum(len(o.new_token_ids) for o in outs if o.request_id == free)
        final.update({o.request_id: o for o in outs if o.finished})
    print(f"\nadmission {admitted_in * 1e3:.1f} ms; first constrained token after {first_token_at:.3f} s; "
          f"{free_tokens_before} free tokens decoded meanwhile")
    assert admitted_in < first_token_at / 4  # add_request did not wait for the compile
    assert first_token_at >= 0.2  # the schema is genuinely slow to compile here
    assert free_tokens_before > 0  # the compile released the GIL: the loop kept stepping
    assert_valid(final[constrained])
    assert final[free].finish_reason == "length" and len(final[free].output_token_ids) == FREE.max_tokens
    assert engine.stats().kv_blocks_used == 0


def test_two_requests_with_one_schema_compile_it_once(engine_dir):
    engine = LLMEngine.from_engine_dir(engine_dir)
    a = engine.add_request("Return JSON:", schema_params())
    b = engine.add_request("Return JSON:", schema_params())  # while a's compile is under way
    final = run_all(engine)
    compiler = engine.grammar_compiler()
    assert (compiler.misses, compiler.hits) == (1, 1)
    assert_valid(final[a])
    assert final[b].output_token_ids == final[a].output_token_ids  # greedy, one prompt, one grammar
    c = engine.add_request("{", schema_params())  # cached now: its matcher is built at admission
    assert_valid(run_all(engine)[c])
    assert (compiler.misses, compiler.hits) == (1, 2)


@pytest.mark.parametrize("kind, guide, words", [
    ("regex", "[^\\x00-\\U0010FFFF]", "admits no output"),
    ("ebnf_grammar", "root ::= [^\\x00-\\U0010FFFF] [a-z]", "admits no output"),
])
def test_a_grammar_refused_after_its_compile_fails_its_request_alone(engine_dir, kind, guide, words):
    alone = LLMEngine.from_engine_dir(engine_dir).generate(["Hello world"], FREE)[0]
    engine = LLMEngine.from_engine_dir(engine_dir)
    free = engine.add_request("Hello world", FREE)
    bad = engine.add_request("x", SamplingParams(guided_decoding_guide_type=kind, guided_decoding_guide=guide,
                                                 max_tokens=20))
    final = run_all(engine)
    assert final[bad].finish_reason == "error" and words in final[bad].error, final[bad].error
    assert "guided_decoding_guide" in final[bad].error and "/project/cpp" not in final[bad].error
    assert final[free].output_token_ids == alone.output_token_ids  # exactly as without it
    assert engine.stats().kv_blocks_used == 0
    # It compiled (and is cached): the next request with it is refused at admission, as today.
    misses = engine.grammar_compiler().misses
    with pytest.raises(ValueError, match=words):
        engine.add_request("x", SamplingParams(guided_decoding_guide_type=kind, guided_decoding_guide=guide))
    assert engine.grammar_compiler().misses == misses
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


def test_an_abort_while_compiling_leaves_nothing_behind(engine_dir):
    engine = LLMEngine.from_engine_dir(engine_dir)
    free = engine.add_request("Hello world", SamplingParams(max_tokens=10, ignore_eos=True))
    constrained = engine.add_request("Return JSON:", schema_params())
    timed = engine.add_request("Return JSON:", schema_params(timeout_s=0.05))  # waits on the same compile
    engine.step()
    assert constrained in engine._compiling  # still compiling (it takes a fraction of a second)
    assert engine.abort(constrained)
    final = run_all(engine)
    assert final[constrained].finish_reason == "abort"
    assert final[timed].finish_reason == "timeout" and final[timed].output_token_ids == []
    assert final[free].finish_reason == "length" and len(final[free].output_token_ids) == 10
    assert len(engine._compiling) == 0 and not engine.has_unfinished()
    assert engine.stats().kv_blocks_used == 0
    # The engine keeps serving: the compile went on into the cache, a new request uses it.
    again = engine.add_request("{", schema_params())
    assert_valid(run_all(engine)[again])
    assert engine.grammar_compiler().misses == 1
    assert engine.stats().kv_blocks_used == 0 and len(engine._compiling) == 0


def test_what_the_queue_refuses_is_refused_at_add_request_while_the_grammar_compiles(engine_dir):
    """A request whose grammar is not compiled yet is checked as `Scheduler.add` would check it when it is
    added (length against max_seq_len here): refused at once, while the engine keeps serving the others."""
    engine = LLMEngine.from_engine_dir(engine_dir)
    free = engine.add_request("Hello world", SamplingParams(max_tokens=5, ignore_eos=True))
    long = SamplingParams(guided_decoding_guide_type="regex", guided_decoding_guide="[a-z]+", max_tokens=300)
    with pytest.raises(ValueError, match="exceeds max_seq_len=256"):  # prompt + max_tokens > max_seq_len=256
        engine.add_request("x", long)
    assert len(engine._compiling) == 0
    final = run_all(engine)
    assert final[free].finish_reason == "length" and len(final[free].output_token_ids) == 5
    assert engine.stats().kv_blocks_used == 0
