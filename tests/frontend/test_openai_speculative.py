"""Speculative decoding through the OpenAI-compatible API: the `speculative` extra body field reaches
the ensemble's `speculative` input (and the engine model's SamplingParams) only when a client sends
it; the ensemble's per-request speculation outputs are read from its last response. The real
engine behind a real tritonserver: tests/e2e/test_speculative_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from tests.frontend.stub_bridge import StubBridge
from tests.helpers.checkpoints import tokenizer as tiny_tokenizer
from trtforge.frontend import server
from trtforge.frontend.generation import Tally
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.triton_bridge import Piece, piece_of
from trtforge.model_repo.request import parse_request
from trtforge.model_repo.speculation import with_speculative_input

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


class RecordingBridge(StubBridge):
    """Answers like the ensemble model of a speculating engine, keeping the arrays it was sent."""

    sent: list = []

    async def generate(self, arrays):
        RecordingBridge.sent.append(arrays)
        yield Piece("ab", [], True, num_input_tokens=2, num_output_tokens=2, finish_reason="length",
                    total_draft_tokens=3, total_accepted_draft_tokens=1, acceptance_rate=1 / 3,
                    avg_decoded_tokens_per_iter=2.0)


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(server, "TritonBridge", RecordingBridge)
    monkeypatch.setattr(RecordingBridge, "sent", [])
    served = ServedModel(name="tiny", engine_dir=Path("/nonexistent"), tokenizer=tiny_tokenizer(), max_seq_len=64)
    with TestClient(server.create_app(served, "127.0.0.1:1"), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_the_opt_out_reaches_the_engine_model_only_when_sent(client, path, body):
    for value in (False, True):
        assert client.post(path, json={**body, "speculative": value}).status_code == 200
        arrays = RecordingBridge.sent[-1]
        assert arrays["speculative"].dtype == np.bool_ and arrays["speculative"].tolist() == [[value]]
        parsed = with_speculative_input(parse_request(arrays), arrays)  # as the engine model reads it
        assert parsed.params.speculative is value
    assert client.post(path, json=body).status_code == 200
    assert "speculative" not in RecordingBridge.sent[-1]  # left out: the engine decides (and other repos lack it)


def test_a_non_boolean_opt_out_is_a_400(client):
    response = client.post("/v1/completions", json={**COMPLETION, "speculative": "sometimes"})
    assert response.status_code == 400, response.text
    assert "speculative" in response.text


def _response(**outputs: tuple[str, np.ndarray]) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name="ensemble")
    for name, (datatype, array) in outputs.items():
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
    response.parameters["triton_final_response"].bool_param = True
    return response


def test_the_bridge_reads_the_speculation_outputs_of_the_last_response():
    text = np.array([[b"x"]], dtype=object)
    final = _response(text_output=("BYTES", text),
                      total_draft_tokens=("INT32", np.array([[12]], dtype=np.int32)),
                      total_accepted_draft_tokens=("INT32", np.array([[3]], dtype=np.int32)),
                      acceptance_rate=("FP32", np.array([[0.25]], dtype=np.float32)),
                      avg_decoded_tokens_per_iter=("FP32", np.array([[1.5]], dtype=np.float32)))
    final.raw_output_contents[0] = serialize_byte_tensor(text).item()
    piece = piece_of(final)
    assert (piece.text, piece.total_draft_tokens, piece.total_accepted_draft_tokens) == ("x", 12, 3)
    assert (piece.acceptance_rate, piece.avg_decoded_tokens_per_iter) == (0.25, 1.5)
    plain = _response(text_output=("BYTES", text))
    plain.raw_output_contents[0] = serialize_byte_tensor(text).item()
    piece = piece_of(plain)
    assert (piece.total_draft_tokens, piece.acceptance_rate, piece.avg_decoded_tokens_per_iter) == (None, None, None)


def test_the_tally_reports_the_last_responses_tokens_per_step():
    served = ServedModel(name="tiny", engine_dir=Path("/nonexistent"), tokenizer=tiny_tokenizer(), max_seq_len=64)
    tally = Tally(served, "Hello", 2)
    tally.add(Piece("a", [], False))
    tally.add(Piece("b", [], True, num_input_tokens=2, num_output_tokens=2, finish_reason="length",
                    avg_decoded_tokens_per_iter=2.0))
    assert tally.avg_decoded_tokens_per_iter() == 2.0
    plain = Tally(served, "Hello", 2)
    plain.add(Piece("ab", [], True, num_input_tokens=2, num_output_tokens=2, finish_reason="length"))
    assert plain.avg_decoded_tokens_per_iter() is None


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_choices_carry_the_engines_tokens_per_step(client, path, body):
    """trtllm-serve's `avg_decoded_tokens_per_iter` on each choice, from the engine's last response: on the
    non-streamed choice and on the streamed final chunk (null on the chunks before it)."""
    assert client.post(path, json=body).json()["choices"][0]["avg_decoded_tokens_per_iter"] == 2.0
    lines = [line[6:] for line in client.post(path, json={**body, "stream": True}).text.splitlines()
             if line.startswith("data: ") and line != "data: [DONE]"]
    values = [c.get("avg_decoded_tokens_per_iter") for line in lines for c in json.loads(line)["choices"]]
    assert values[-1] == 2.0 and all(v is None for v in values[:-1])
