"""The OpenAI front end in front of a `--backend trtllm` repository (frontend/trtllm_interface.py,
trtllm_requests.py), checked against the recorded interface of each TensorRT-LLM release (the
test data tests/model_repo/trtllm/upstream_<tag>.json) and against the ensemble config.pbtxt that
emit-repo writes for it, on CPU. TensorRT-LLM itself behind a real tritonserver:
tests/e2e/test_openai_trtllm.py (GPU only)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from tests.frontend.trtllm_repo import trtllm_repo
from tests.helpers.checkpoints import build_tiny_engine
from tests.model_repo.trtllm.conftest import record_of
from trtforge.builder.trtllm.versions import RELEASES
from trtforge.frontend.errors import APIError
from trtforge.frontend.generation import Tally
from trtforge.frontend.schemas import ChatCompletionRequest, CompletionRequest
from trtforge.frontend.served_model import ServedModel, load_served_model
from trtforge.frontend.triton_bridge import Piece
from trtforge.frontend.trtllm_interface import TrtllmInterface, load_interface, release_of
from trtforge.frontend.trtllm_requests import stop_trimmed, trtllm_inputs
from trtforge.model_repo.pbtxt import read_config
from trtforge.model_repo.trtllm import upstream as U

VERSIONS = tuple(RELEASES)
NUMPY = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32,
         "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}
EVERY_FIELD = {"model": "m", "prompt": "Hi", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 4,
               "seed": 7, "presence_penalty": 0.5, "frequency_penalty": -0.5, "stop": ["\n\n", "END"],
               "min_tokens": 2, "ignore_eos": True, "logprobs": 0}
"""Every field a TensorRT-LLM ensemble of each recorded release can honour."""


def interface(version: str, guided: bool = False) -> TrtllmInterface:
    release = RELEASES[version]
    return TrtllmInterface(release, {t.name: t for t in U.tensors("ensemble", "inputs", release)},
                           frozenset(t.name for t in U.tensors("ensemble", "outputs", release)),
                           guided_decoding=guided, skips_special_tokens=True)


def recorded_inputs(version: str) -> dict[str, tuple[str, list[int]]]:
    """{name: (type, dims)} of the release's ensemble inputs, from the test data's record."""
    return {name: (dtype, dims) for name, dtype, dims, *_ in record_of(version)["models"]["ensemble"]["inputs"]}


def sent(version: str, body: dict, **kw) -> dict[str, np.ndarray]:
    request = (ChatCompletionRequest if "messages" in body else CompletionRequest)(**body)
    return trtllm_inputs(interface(version, kw.pop("guided", False)), request, "Hi", request.max_tokens or 5,
                         seed=request.seed, **kw)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_input_sent_is_the_releases_with_its_type_and_shape(version):
    record = recorded_inputs(version)
    arrays = sent(version, EVERY_FIELD)
    for name, array in arrays.items():
        assert name in record, f"{name} is not an input of TensorRT-LLM {version}'s ensemble"
        dtype, dims = record[name]
        assert array.dtype == NUMPY[dtype], name
        assert array.ndim == len(dims) + 1 and array.shape[0] == 1, name  # batch of one
        assert all(d == -1 or d == n for d, n in zip(dims, array.shape[1:])), name
    required = {name for name, _, _, optional, *_ in record_of(version)["models"]["ensemble"]["inputs"]
                if not optional}
    assert required <= set(arrays)


def test_0_19_names_seed_and_min_tokens_its_own_way_and_ignore_eos_is_end_id_minus_one():
    arrays = sent("0.19.0", EVERY_FIELD)
    assert arrays["random_seed"].tolist() == [[7]] and arrays["random_seed"].dtype == np.uint64
    assert arrays["min_length"].tolist() == [[2]] and arrays["min_length"].dtype == np.int32
    assert arrays["end_id"].tolist() == [[-1]] and arrays["end_id"].dtype == np.int32
    assert "seed" not in arrays and "min_tokens" not in arrays
    assert arrays["stop_words"].tolist() == [[b"\n\n", b"END"]]  # one word per element, no CSV quoting
    assert arrays["return_log_probs"].tolist() == [[True]]  # how 0.19 counts the tokens of a response
    assert not {"return_num_input_tokens", "return_num_output_tokens"} & set(arrays)
    assert arrays["top_k"].tolist() == [[4]] and arrays["temperature"].tolist() == [[pytest.approx(0.7)]]


def test_1_2_takes_seed_and_min_tokens_and_reports_the_counts():
    arrays = sent("1.2.0rc8", {**EVERY_FIELD, "logprobs": None})
    assert arrays["seed"].tolist() == [[7]] and arrays["seed"].dtype == np.uint64
    assert arrays["min_tokens"].tolist() == [[2]] and arrays["end_id"].tolist() == [[-1]]
    assert arrays["return_num_input_tokens"].tolist() == arrays["return_num_output_tokens"].tolist() == [[True]]
    assert "return_log_probs" not in arrays  # counted by num_output_tokens; logprobs not asked for


@pytest.mark.parametrize("version", VERSIONS)
def test_greedy_and_no_top_k_as_tensorrt_llm_spells_them(version):
    greedy = sent(version, {"model": "m", "prompt": "Hi", "temperature": 0, "top_p": 0})
    assert greedy["top_k"].tolist() == [[1]] and "temperature" not in greedy
    assert greedy["top_p"].tolist() == [[pytest.approx(1e-6)]]
    assert sent(version, {"model": "m", "prompt": "Hi", "top_k": -1})["top_k"].tolist() == [[0]]


ABSENT = [
    ({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2}, {}, "top_logprobs"),
    ({"prompt": "Hi", "logprobs": 2}, {}, "logprobs"),
    ({"prompt": "Hi", "prompt_logprobs": 1}, {}, "prompt_logprobs"),
    ({"prompt": "Hi", "echo": True, "logprobs": 0}, {}, "echo with logprobs"),
    ({"prompt": "Hi"}, {"cache_salt": "tenant"}, "cache_salt"),
    ({"prompt": "Hi", "speculative": False}, {}, "speculative"),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("body", "kw", "field"), ABSENT, ids=[a[2] for a in ABSENT])
def test_a_field_the_release_lacks_is_a_400_naming_it_and_the_release(version, body, kw, field):
    with pytest.raises(APIError) as info:
        sent(version, {"model": "m", **body}, **kw)
    assert info.value.status == 400
    assert str(info.value).startswith(f"{field}: TensorRT-LLM {version}'s ensemble has no input for it")


@pytest.mark.parametrize("version", VERSIONS)
def test_skip_special_tokens_is_the_repositorys_and_guides_need_a_guided_decoding_backend(version):
    assert sent(version, {"model": "m", "prompt": "Hi", "skip_special_tokens": True})  # what the repo does
    with pytest.raises(APIError, match=f"skip_special_tokens=false: TensorRT-LLM {version}'s ensemble has no "
                                       "input for it; the repository's postprocessing model decides"):
        sent(version, {"model": "m", "prompt": "Hi", "skip_special_tokens": False})
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_object"}}
    with pytest.raises(APIError, match="has no guided_decoding_backend"):
        sent(version, body)
    arrays = sent(version, body, guided=True)
    assert arrays["guided_decoding_guide_type"].tolist() == [[b"json"]]


def _tally(version: str, pieces: list[Piece], max_tokens: int) -> Tally:
    from tests.helpers.checkpoints import tokenizer

    served = ServedModel(name="m", engine_dir=Path("/nonexistent"), tokenizer=tokenizer(), max_seq_len=64,
                         trtllm=interface(version))
    tally = Tally(served, "Hello there", max_tokens)
    for piece in pieces:
        tally.add(piece)
    return tally


def test_0_19_usage_and_finish_reason_come_from_the_responses_log_probs():
    from tests.helpers.checkpoints import tokenizer

    pieces = [Piece("a", [-0.1, -0.2], False), Piece("b", [-0.3], True)]  # streamed: each its new tokens
    tally = _tally("0.19.0", pieces, max_tokens=3)
    prompt = len(tokenizer().encode("Hello there", add_special_tokens=False))  # as preprocessing encodes it
    assert tally.usage().model_dump(exclude_none=True) == {
        "prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}
    assert tally.finish_reason() == "length" and tally.stop_reason() is None
    assert _tally("0.19.0", pieces, max_tokens=4).finish_reason() == "stop"  # ended before max_tokens


def test_1_2_usage_is_its_num_input_and_num_output_tokens_summed_per_response():
    pieces = [Piece("a", [], False, num_input_tokens=9, num_output_tokens=2),
              Piece("b", [], True, num_input_tokens=9, num_output_tokens=1)]
    usage = _tally("1.2.0rc8", pieces, max_tokens=8).usage()
    assert (usage.prompt_tokens, usage.completion_tokens) == (9, 3)


async def _pieces(texts: list[str]):
    for i, text in enumerate(texts):
        yield Piece(text, [-0.1], i == len(texts) - 1)


def _trimmed(texts: list[str], stops: list[str]) -> list[Piece]:
    async def run():
        return [p async for p in stop_trimmed(_pieces(texts), stops)]
    return asyncio.run(run())


def test_the_stop_string_tensorrt_llm_keeps_is_cut_even_split_across_responses():
    out = _trimmed(["Hello E", "N", "D more", ""], ["END"])
    assert "".join(p.text for p in out) == "Hello "
    assert [p.stop_reason for p in out] == [None, None, None, "END"]
    assert [len(p.logprobs) for p in out] == [1, 1, 1, 1]  # the counts stay as they came
    kept = _trimmed(["a E", "ND"[0], "x"], ["END"])  # a stop string's start that did not become one
    assert "".join(p.text for p in kept) == "a ENx" and kept[-1].stop_reason is None


@pytest.fixture(scope="module")
def torch_engine(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("eng"), "qwen2")


@pytest.mark.parametrize("version", VERSIONS)
def test_the_emitted_repository_is_served_with_its_releases_interface(torch_engine, tmp_path, version):
    repo = trtllm_repo(torch_engine, tmp_path, version)
    served = load_served_model(repo)
    assert served.trtllm is not None and served.trtllm.release == RELEASES[version]
    assert served.engine_dir.resolve() == (tmp_path / "engine").resolve() and served.max_seq_len == 64
    assert not served.trtllm.guided_decoding and served.trtllm.skips_special_tokens  # as emit-repo writes them
    config = {i.name: i for i in read_config(repo / "ensemble" / "config.pbtxt").input}
    request = CompletionRequest(**EVERY_FIELD)
    for name, array in trtllm_inputs(served.trtllm, request, "Hi", 5, seed=7).items():
        assert name in config, f"the emitted ensemble has no input {name}"
        assert array.dtype == NUMPY[mc.DataType.Name(config[name].data_type)], name
        assert array.ndim == len(config[name].dims) + 1, name
    assert {n for n, i in config.items() if not i.optional} <= set(trtllm_inputs(served.trtllm, request, "Hi", 5))


def test_a_repository_matching_no_record_is_refused_naming_the_difference(torch_engine, tmp_path):
    repo = trtllm_repo(torch_engine, tmp_path, "0.19.0")
    path = repo / "ensemble" / "config.pbtxt"
    path.write_text(path.read_text().replace('"random_seed"', '"rng_seed"'))
    with pytest.raises(ValueError, match=r"match no recorded release .*closest: 0\.19\.0, differing in "
                                         r"random_seed, rng_seed"):
        release_of(repo)
    shutil.rmtree(repo / "postprocessing")
    path.write_text(path.read_text().replace('"rng_seed"', '"random_seed"'))
    assert load_interface(repo).skips_special_tokens  # the backend's default when the model is absent


class TrtllmLikeBridge:
    """Answers as TensorRT-LLM 0.19.0's ensemble does, streamed: each response the text and log
    probabilities of the tokens it added, nothing about why the request ended; the stop word is
    kept in the output. Checks every input it gets against the release's record."""

    sent: list = []

    def __init__(self, url: str, model: str) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ready(self) -> bool:
        return True

    async def generate(self, arrays):
        record = recorded_inputs("0.19.0")
        for name, array in arrays.items():
            assert name in record and array.dtype == NUMPY[record[name][0]], name
        TrtllmLikeBridge.sent.append(arrays)
        stops = [s.decode() for s in arrays["stop_words"].reshape(-1)] if "stop_words" in arrays else []
        yield Piece("Hello E", [-0.1, -0.2], False)
        yield Piece("ND" if "END" in stops else "NDS", [-0.3], True)


@pytest.fixture
def client(monkeypatch, torch_engine, tmp_path):
    from fastapi.testclient import TestClient

    from trtforge.frontend import server

    monkeypatch.setattr(server, "TritonBridge", TrtllmLikeBridge)
    monkeypatch.setattr(TrtllmLikeBridge, "sent", [])
    served = load_served_model(trtllm_repo(torch_engine, tmp_path, "0.19.0"), name="m")
    with TestClient(server.create_app(served, "127.0.0.1:1"), raise_server_exceptions=False) as client:
        yield client


def test_through_the_api_the_stop_string_is_cut_and_the_usage_counted(client):
    body = {"model": "m", "prompt": "Hello there", "max_tokens": 8, "stop": "END", "seed": 3}
    choice = (answer := client.post("/v1/completions", json=body).json())["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("Hello ", "stop", "END")
    assert answer["usage"]["completion_tokens"] == 3
    assert TrtllmLikeBridge.sent[-1]["random_seed"].tolist() == [[3]]
    plain = client.post("/v1/completions", json={**body, "stop": None, "max_tokens": 3}).json()["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == ("Hello ENDS", "length")
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stop": ["END"],
            "stream": True, "stream_options": {"include_usage": True}}
    lines = [line[6:] for line in client.post("/v1/chat/completions", json=chat).text.splitlines()
             if line.startswith("data: ")]
    events = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert lines[-1] == "[DONE]" and text == "Hello "
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1]["usage"]["completion_tokens"] == 3


def test_through_the_api_an_absent_field_is_a_400_before_triton_is_asked(client):
    response = client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        "top_logprobs: TensorRT-LLM 0.19.0's ensemble has no input for it")
    assert TrtllmLikeBridge.sent == []


def test_per_key_cache_salts_are_refused_at_start(torch_engine, tmp_path):
    from trtforge.frontend import server
    from trtforge.frontend.guard import Limits

    served = load_served_model(trtllm_repo(torch_engine, tmp_path, "1.2.0rc8"))
    with pytest.raises(ValueError, match="TensorRT-LLM 1.2.0rc8's ensemble has no cache_salt input"):
        server.create_app(served, "127.0.0.1:1", Limits(api_keys=("k",), api_key_cache_salt=True))
