"""The Dynamo worker's own parts, without Dynamo's runtime (the e2e test runs the real frontend):
Dynamo's request dict → SamplingParams, KV events grouped as Dynamo's publisher takes them, the
model card, and the engine loop (asyncio callers, one engine thread, cancellation, a bad request
failing alone)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.serving.test_disaggregated_engine import engine_dir  # noqa: F401 - fixture
from trtforge.dynamo_backend.engine_loop import EngineLoop
from trtforge.dynamo_backend.model_card import write_model_card
from trtforge.dynamo_backend.publish import stored_runs
from trtforge.dynamo_backend.requests import prompt_token_ids, sampling_params
from trtforge.serving.core.kv_events import BlockRemoved, BlockStored
from trtforge.serving.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_dynamo_requests_map_onto_sampling_params():
    params = sampling_params({
        "token_ids": [1, 2, 3],
        "sampling_options": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "n": 1, "best_of": None,
                             "presence_penalty": None},
        "stop_conditions": {"max_tokens": 9, "min_tokens": 2, "stop": ["x"], "stop_token_ids_hidden": [0],
                            "stop_token_ids": [7]},
        "output_options": {"logprobs": 1}}, default_max_tokens=100)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 5, 3)
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (9, 2, 1)
    assert params.stop_token_ids == [0, 7] and params.stop == []  # stop strings are the frontend's
    # ignore_eos drops the model's EOS ids (the hidden ones), not the client's own stop ids.
    eos_ignored = sampling_params({"token_ids": [1], "stop_conditions": {
        "ignore_eos": True, "stop_token_ids_hidden": [0], "stop_token_ids": [7]}}, default_max_tokens=4)
    assert eos_ignored.stop_token_ids == [7] and eos_ignored.ignore_eos and eos_ignored.max_tokens == 4


@pytest.mark.parametrize("request_dict,message", [
    ({"token_ids": []}, "empty"),
    ({"token_ids": "abc"}, "list of at most"),
    ({"token_ids": [1, True]}, "list of at most"),
    ({"token_ids": [1], "sampling_options": {"n": 2}}, "n=2 is not supported"),
    ({"token_ids": [1], "sampling_options": {"use_beam_search": True}}, "use_beam_search"),
    ({"token_ids": [1], "sampling_options": {"temperature": float("nan")}}, "not finite"),
    ({"token_ids": [1], "sampling_options": {"temperature": "hot"}}, "not a number"),
    ({"token_ids": [1], "sampling_options": {"top_k": 1.5}}, "not an integer"),
    ({"token_ids": [1], "sampling_options": {"repetition_penalty": -1.0}}, "repetition_penalty"),
    ({"token_ids": [1], "stop_conditions": {"max_tokens": 0}}, "max_tokens"),
    ({"token_ids": [1], "stop_conditions": {"stop_token_ids": [1.5]}}, "stop_token_ids"),
    ({"token_ids": [1], "sampling_options": []}, "must be objects"),
    ({"token_ids": [1], "cache_salt": 5}, "cache_salt"),
])
def test_bad_dynamo_requests_are_refused_by_name(request_dict, message):
    with pytest.raises(ValueError, match=message):
        prompt_token_ids(request_dict)
        sampling_params(request_dict, default_max_tokens=8)


def test_kv_events_are_grouped_into_chained_runs():
    k = [bytes([i]) * 32 for i in range(6)]
    events = [BlockStored(k[0], None, (1, 2)), BlockStored(k[1], k[0], (3, 4)),  # one chain
              BlockStored(k[2], None, (5, 6)),  # a new sequence: a new run
              BlockRemoved(k[3]), BlockRemoved(k[4]),
              BlockStored(k[5], k[2], (7, 8), cache_salt="s")]  # another salt: its own run
    runs = stored_runs(events)
    assert [kind for kind, _ in runs] == ["stored", "stored", "removed", "stored"]
    assert [b.key for b in runs[0][1][0]] == [k[0], k[1]] and runs[0][1][1] is None
    assert runs[2][1] == [k[3], k[4]]
    assert runs[3][1][1] == k[2] and runs[3][1][2] == "s"


def test_model_card_holds_config_and_the_engines_tokenizer(engine_dir, tmp_path):  # noqa: F811
    engine = LLMEngine.from_engine_dir(engine_dir)
    card = write_model_card(engine_dir, engine.engine_config, 128, tmp_path / "card")
    config = json.loads((card / "config.json").read_text())
    model = engine.engine_config.model
    assert config["vocab_size"] == model.vocab_size and config["max_position_embeddings"] == 128
    assert (card / "tokenizer.json").read_bytes() == (engine_dir / "tokenizer.json").read_bytes()
    assert not list(card.glob("rank*"))  # no weights
    # A second worker finds it in place (the same folder: the frontend compares cards).
    assert write_model_card(engine_dir, engine.engine_config, 128, card) == card


def test_engine_loop_serves_asyncio_callers_cancels_and_isolates_bad_requests(engine_dir):  # noqa: F811
    from trtforge.config.sampling import SamplingParams

    engine = LLMEngine.from_engine_dir(engine_dir)
    prompt = engine.tokenizer.encode("Hello, world!")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    (expected,) = engine.generate([prompt], params)
    loop = EngineLoop(engine)

    async def run(rid: str, ids, p) -> list:
        outputs, got = loop.submit(rid, ids, p), []
        while True:
            item = await outputs.get()
            got.append(item)
            if isinstance(item, BaseException) or item.finished:
                return got

    async def main():
        long = SamplingParams(max_tokens=100, ignore_eos=True)
        cancelled = loop.submit("cancel-me", prompt, long)
        first = await cancelled.get()  # running: it holds blocks
        loop.cancel("cancel-me")
        results = await asyncio.gather(run("a", prompt, params), run("b", prompt, params),
                                       run("too-long", prompt * 100, params))
        rest = [first]
        while not rest[-1].finished:
            rest.append(await cancelled.get())
        return results, rest

    try:
        (a, b, bad), cancelled = asyncio.run(main())
        assert [t for o in a for t in o.new_token_ids] == expected.output_token_ids
        assert [t for o in b for t in o.new_token_ids] == expected.output_token_ids
        assert isinstance(bad[-1], ValueError) and "too long" in str(bad[-1])
        assert cancelled[-1].finish_reason == "abort" and len(cancelled[-1].output_token_ids) < 100
    finally:
        loop.close()
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()


_HANDLE = dict(request_id="r", location="/dev/shm/x", slot=0, nonce=1, blocks=[0], num_tokens=3, block_size=8,
               deadline=0.0, nbytes=0, prompt_token_ids=[1, 2, 3], first_token=5, seed=0)


@pytest.mark.parametrize(("params", "message"), [
    (None, "needs the prefill worker's result"),
    ({"disaggregated_params": None}, "must hold"),
    ({"disaggregated_params": {"trtforge_kv_handle": "{}", "trtforge_finished": {}}}, "must hold"),
    ({"disaggregated_params": {"trtforge_kv_handle": 7}}, "must be a string"),
    ({"disaggregated_params": {"trtforge_kv_handle": "[1]"}}, "malformed context_phase_params"),
    ({"disaggregated_params": {"trtforge_kv_handle": json.dumps({**_HANDLE, "evil": 1})}}, "unknown field"),
    ({"disaggregated_params": {"trtforge_kv_handle": json.dumps({**_HANDLE, "prompt_token_ids": [9]})}},
     "another prompt"),
    ({"disaggregated_params": {"trtforge_finished": {"token": 10 ** 9, "reason": "stop"}}}, "malformed"),
    ({"disaggregated_params": {"trtforge_finished": {"token": True, "reason": "stop"}}}, "malformed"),
    ({"disaggregated_params": {"trtforge_finished": {"token": 3, "reason": "handoff"}}}, "malformed"),
])
def test_a_decode_workers_prefill_result_is_checked_before_use(params, message):
    from trtforge.dynamo_backend.disagg import parse_prefill_result

    with pytest.raises(ValueError, match=message):
        parse_prefill_result({"prefill_result": params}, [1, 2, 3], vocab_size=100)


def test_a_prefill_result_gives_the_handle_or_the_finished_token():
    from trtforge.dynamo_backend.disagg import FinishedAtPrefill, parse_prefill_result

    handle = parse_prefill_result({"prefill_result": {"disaggregated_params": {
        "trtforge_kv_handle": json.dumps(_HANDLE)}}}, [1, 2, 3], vocab_size=100)
    assert (handle.first_token, handle.prompt_token_ids) == (5, [1, 2, 3])  # its signature: check_handoff's
    done = parse_prefill_result({"prefill_result": {"disaggregated_params": {
        "trtforge_finished": {"token": 4, "reason": "stop"}}}}, [1, 2, 3], vocab_size=100)
    assert done == FinishedAtPrefill(4, "stop")


@pytest.mark.parametrize(("spec", "expected"), [
    ({"json": {"type": "object"}}, ("json_schema", '{"type": "object"}')),
    ({"regex": "[0-9]+", "backend": "xgrammar"}, ("regex", "[0-9]+")),
    ({"choice": ["yes", 'n"o']}, ("ebnf_grammar", 'root ::= "yes" | "n\\"o"')),
    ({"grammar": "root ::= \"a\""}, ("ebnf_grammar", 'root ::= "a"')),
    ({"json_object": True}, ("json", None)),
])
def test_dynamo_guided_decoding_maps_onto_our_guides(spec, expected):
    params = sampling_params({"token_ids": [1], "sampling_options": {"guided_decoding": spec}}, default_max_tokens=4)
    assert (params.guided_decoding_guide_type, params.guided_decoding_guide) == expected


@pytest.mark.parametrize(("spec", "message"), [
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({}, "exactly one"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern not supported"),
    ({"regex": "a", "backend": "outlines"}, "uses xgrammar"),
    ({"choice": ["", "x"]}, "non-empty strings"),
    ("regex", "must be an object"),
])
def test_bad_guided_decoding_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        sampling_params({"token_ids": [1], "sampling_options": {"guided_decoding": spec}}, default_max_tokens=4)
