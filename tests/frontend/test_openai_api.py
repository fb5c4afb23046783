"""The OpenAI-compatible API without a server: request models, what reaches the ensemble (read back
by the model's own request parser), error mapping, usage and finish reasons, the schema."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from tests.helpers.checkpoints import tokenizer as tiny_tokenizer
from trtforge.frontend.errors import APIError, _field_path
from trtforge.frontend.generation import TOP_P_MOST_LIKELY, Tally, csv_field, ensemble_inputs
from trtforge.frontend.schemas import ChatCompletionRequest, CompletionRequest
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.server import create_app
from trtforge.frontend.triton_bridge import Piece, error_for_message
from trtforge.model_repo.request import parse_request, parse_words

# Stop strings as JSON can carry them: any text but lone surrogates (refused by the schema).
stop_text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(stop_text, min_size=1, max_size=4))
def test_stop_strings_reach_the_ensemble_unchanged(stops):
    """Each stop string is one CSV field the ensemble's stop_words parser reads back exactly,
    commas, quotes, newlines and NULs included."""
    array = np.array([[csv_field(w).encode("utf-8") for w in stops]], dtype=object)
    assert parse_words(array, "stop_words") == stops


def test_completion_request_maps_to_sampling_params():
    body = CompletionRequest(model="m", prompt=["Hi"], max_tokens=5, top_p=0, seed=2**64 - 1,
                             presence_penalty=0.5, frequency_penalty=-1, top_k=3,
                             stop=["a,b", "\n"])
    parsed = parse_request(ensemble_inputs(body, body.prompt_text(), 5))
    p = parsed.params
    # Log-probabilities only when asked for (the model's counts come on its last response anyway).
    assert parsed.prompt == "Hi" and parsed.stream and not parsed.return_log_probs and p.logprobs is None
    assert (p.max_tokens, p.seed, p.top_k, p.stop) == (5, 2**64 - 1, 3, ["a,b", "\n"])
    assert p.temperature == 1.0  # OpenAI's default, not the ensemble's greedy one
    assert p.top_p == pytest.approx(TOP_P_MOST_LIKELY)  # OpenAI's 0: the most likely token
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -1.0)
    greedy = parse_request(ensemble_inputs(CompletionRequest(model="m", prompt="x",
                                                             temperature=0), "x", 16))
    assert greedy.params.is_greedy and greedy.params.stop == [] and greedy.params.min_tokens == 0
    exact = CompletionRequest(model="m", prompt="x", ignore_eos=True, min_tokens=2)
    assert parse_request(ensemble_inputs(exact, "x", 9)).params.min_tokens == 9
    at_least = CompletionRequest(model="m", prompt="x", min_tokens=2)
    assert parse_request(ensemble_inputs(at_least, "x", 9)).params.min_tokens == 2


@pytest.mark.parametrize("body, logprobs", [
    (CompletionRequest(model="m", prompt="x", logprobs=0), 0),
    (CompletionRequest(model="m", prompt="x", logprobs=20), 20),
    (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True), 0),
    (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True,
                           top_logprobs=7), 7),
    (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=0), None),
])
def test_logprobs_and_their_alternatives_reach_the_ensemble(body, logprobs):
    parsed = parse_request(ensemble_inputs(body, "x", 4))
    assert parsed.params.logprobs == logprobs
    assert (parsed.return_log_probs, parsed.num_top_logprobs) == (logprobs is not None, logprobs or 0)


@pytest.mark.parametrize("fields, param, words", [
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
    ({"prompt_logprobs": 1, "stream": True}, "", "not available with stream=true"),
    ({"prompt": [1, 2]}, "prompt", "token-id prompts are not supported"),
    ({"prompt": ["a", "b"]}, "prompt", "one text prompt"),
    ({"prompt": "\ud800"}, "prompt", "unicode"),
    ({"prompt": ""}, "prompt", "at least 1 character"),
    ({"best_of": 2}, "best_of", "not supported"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"stop": ["x"] * 17}, "stop", "at most 16"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias", "not supported"),
])
def test_refused_completion_fields_name_themselves(fields, param, words):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
    errors = info.value.errors()
    assert ".".join(_field_path(errors[0]["loc"])) == param
    assert any(words in e["msg"] for e in errors), errors


def test_chat_request_limits():
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**ok, "max_tokens": 3,
                                                 "max_completion_tokens": 7}).token_limit() == 7
    for fields in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"prompt_logprobs": 21},
                   {"prompt_logprobs": 0, "stream": True},
                   {"tools": [{"type": "function"}]}, {"messages": []},
                   {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                   {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                   {"response_format": {"type": "json_schema"}}, {"response_format": {"type": "xml"}}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({**ok, **fields})


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("fields, kind, guide", [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "json", None),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}}, "json_schema", SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, "json", None),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": '{"type": "array"}'}}, "json_schema", {"type": "array"}),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, "regex", "[0-9]{3}"),
    ({"structured_outputs": {"choice": ["yes", 'say "no"', "ü\\n"]}}, "ebnf_grammar",
     'root ::= "yes" | "say \\"no\\"" | "ü\\\\n"'),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "ebnf_grammar", 'root ::= "a" | "b"'),
    ({"structured_outputs": {"json_object": True}}, "json", None),
    ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, "regex", "a"),
])
def test_structured_output_fields_reach_the_ensemble(fields, kind, guide):
    """response_format and vLLM's structured_outputs become the ensemble's guided_decoding inputs,
    read back by the model's own request parser."""
    p = parse_request(ensemble_inputs(ChatCompletionRequest.model_validate({**CHAT, **fields}), "hi", 8)).params
    got = p.guided_decoding_guide
    if kind in ("json_schema",):
        got = json.loads(got)
    assert (p.guided_decoding_guide_type, got or None) == (kind, guide)
    if "structured_outputs" in fields:  # the same field on the legacy completions API
        body = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
        assert parse_request(ensemble_inputs(body, "x", 8)).params.guided_decoding_guide_type == kind


@pytest.mark.parametrize("structured, words", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"choice": []}, "at least 1 item"), ({"regex": ""}, "at least 1 character"),
    ({"choice": ["a"] * 257}, "at most 256 items"),
])
def test_bad_structured_outputs_are_refused(structured, words):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "structured_outputs": structured})
    assert any(words in e["msg"] for e in info.value.errors()), info.value.errors()


@pytest.mark.parametrize("message, status", [
    ("bad request: request triton-3: prompt of 9000 tokens ...", 400),
    ("server busy, retry later: 8 requests are waiting for admission", 503),
    ("the model is being unloaded; retry on another instance.", 503),
    ("Request for unknown model: 'ensemble' is not found", 503),
    ("engine step failed: RuntimeError: boom", 500),
])
def test_triton_errors_map_to_statuses(message, status, caplog):
    error = error_for_message(message)
    assert isinstance(error, APIError) and error.status == status
    if status < 500:  # the model's refusal says what was wrong
        assert message in error.body.message
    else:  # Triton's own words go to the log, the client gets the kind and the request id
        assert message not in error.body.message and "request id" in error.body.message
        assert message in caplog.text


def _served(tok=None, max_seq_len: int = 64) -> ServedModel:
    return ServedModel(name="tiny", engine_dir=None, tokenizer=tok, max_seq_len=max_seq_len)


def test_usage_and_finish_reason_are_the_models_own():
    tally = Tally(_served(tiny_tokenizer()), "Hello world", max_tokens=3)
    tally.add(Piece("He", [-0.5], final=False, top_logprobs=[[(5, -0.5), (6, -1.5)]]))
    tally.add(Piece("", [-0.25, -1.0], final=True, num_input_tokens=2, num_output_tokens=3,
                    top_logprobs=[[(7, -0.25), (5, -2.0)], [(8, -1.0), (9, -1.1)]],
                    finish_reason="stop", stop_reason=8, num_cached_tokens=1))
    assert tally.text == "He" and tally.token_texts == ["He", "", ""]
    assert tally.top_logprobs[1] == [(7, -0.25), (5, -2.0)]
    assert tally.usage().model_dump() == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                          "prompt_tokens_details": {"cached_tokens": 1}}
    # EOS on the last allowed token: the model says "stop" (no guess from the counts).
    assert (tally.finish_reason(), tally.stop_reason()) == ("stop", 8)
    # A last response without the model's finish_reason and counts (a model older than the front
    # end): a 500 saying so, not a guess.
    tally = Tally(_served(tiny_tokenizer()), "Hello world", max_tokens=3)
    tally.add(Piece("x", [-1.0], final=True, num_input_tokens=2, num_output_tokens=1))
    with pytest.raises(APIError) as info:
        tally.finish_reason()
    assert info.value.status == 500


def test_top_logprobs_name_each_alternative_by_its_own_text():
    from trtforge.frontend.generation import chat_logprobs, completion_logprobs

    tok = tiny_tokenizer()
    served = _served(tok)
    ids = tok.encode("hello world", add_special_tokens=False)[:2]
    top = [[(ids[0], -0.1), (ids[1], -2.0)], [(ids[1], -0.3), (ids[0], -1.0)]]
    chat = chat_logprobs(served, ["a", "b"], [-0.1, -0.3], top, 2)
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in chat.content] == \
        [[(tok.decode([i]), lp) for i, lp in row] for row in top]
    assert chat.content[0].top_logprobs[0].bytes == list(tok.decode([ids[0]]).encode())
    assert all(c.top_logprobs == [] for c in chat_logprobs(served, ["a", "b"], [-0.1, -0.3], [], 0).content)
    legacy = completion_logprobs(served, ["a", "b"], [-0.1, -0.3], top, 2, offset=3)
    assert legacy.text_offset == [3, 4] and legacy.top_logprobs[1] == {tok.decode([ids[1]]): -0.3,
                                                                       tok.decode([ids[0]]): -1.0}
    assert completion_logprobs(served, ["a"], [-0.1], [], 0).top_logprobs is None


def test_chat_template_or_a_clear_400():
    tok = tiny_tokenizer()
    from trtforge.frontend.schemas import ChatMessage

    messages = [ChatMessage(role="developer", content="Be brief."),
                ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}])]
    prompt = _served(tok).chat_prompt(messages)
    assert prompt == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False, add_generation_prompt=True)

    class NoTemplate:
        chat_template = None

    with pytest.raises(APIError) as info:
        _served(NoTemplate()).chat_prompt(messages)
    assert info.value.status == 400 and "no chat template" in info.value.body.message


def test_openapi_schema_documents_400_not_422():
    spec = create_app(_served(), "127.0.0.1:1").openapi()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "503"} <= set(responses) and "422" not in responses
    assert {"CompletionRequest", "ChatCompletionRequest", "ErrorResponse"} \
        <= set(spec["components"]["schemas"])
