"""`cache_salt` through the OpenAI-compatible API (the real app, FastAPI's TestClient, in front of
a bridge that records what would go to Triton and reads it back with the Triton model's own
parser): the field is accepted, bounded and passed through; with `api_key_cache_salt` every API
key gets its own salt, which a client's salt divides but cannot leave. That different salts
never share prefix-cache blocks is tests/serving/test_engine.py's and test_kv_cache_manager.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.frontend.stub_bridge import StubBridge
from tests.helpers.checkpoints import tokenizer as tiny_tokenizer
from trtforge.frontend import server
from trtforge.frontend.guard import Limits
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.triton_bridge import Piece
from trtforge.model_repo.request import parse_request

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


class RecordingBridge(StubBridge):
    """TritonBridge's interface: records each request as the ensemble model would parse it."""

    sent: list = []

    async def generate(self, arrays):
        RecordingBridge.sent.append((dict(arrays), parse_request(arrays)))
        yield Piece("ok", [-0.5], True, num_input_tokens=1, num_output_tokens=1, finish_reason="length")


@pytest.fixture
def sent(monkeypatch):
    monkeypatch.setattr(server, "TritonBridge", RecordingBridge)
    monkeypatch.setattr(RecordingBridge, "sent", [])
    return RecordingBridge.sent


def _client(**limits) -> TestClient:
    served = ServedModel(name="tiny", engine_dir=Path("/nonexistent"), tokenizer=tiny_tokenizer(),
                         max_seq_len=64)
    return TestClient(server.create_app(served, "127.0.0.1:1", Limits(**limits)),
                      raise_server_exceptions=False)


def _salt(client: TestClient, sent: list, body: dict, key: str | None = None,
          path: str = "/v1/completions") -> str | None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    arrays, parsed = sent[-1]
    if parsed.params.cache_salt is None:
        assert "cache_salt" not in arrays  # absent, not empty
    return parsed.params.cache_salt


def test_cache_salt_is_accepted_and_passed_through(sent):
    with _client() as client:
        _passed_through(client, sent)


def _passed_through(client: TestClient, sent: list) -> None:
    assert _salt(client, sent, {**COMPLETION, "cache_salt": "tenant-7"}) == "tenant-7"
    assert _salt(client, sent, {**CHAT, "cache_salt": "sél ü"}, path="/v1/chat/completions") == "sél ü"
    assert _salt(client, sent, COMPLETION) is None
    assert "cache_salt" in client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"][
        "properties"]


@pytest.mark.parametrize("salt", ["", "s" * 257, 42, "\ud800"])
def test_a_bad_cache_salt_is_a_400_naming_it(sent, salt):
    with _client() as client:
        response = client.post("/v1/completions", content=json.dumps({**COMPLETION, "cache_salt": salt}),
                               headers={"Content-Type": "application/json"})  # \ud800 as JSON sends it
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"
    assert sent == []  # refused before anything went to Triton


def test_each_api_key_gets_its_own_salt_which_a_client_salt_only_divides(sent):
    with _client(api_key=KEY_A, api_keys=(KEY_B,), api_key_cache_salt=True) as client:
        _salted_per_key(client, sent)


def _salted_per_key(client: TestClient, sent: list) -> None:
    salt_a, salt_b = _salt(client, sent, COMPLETION, KEY_A), _salt(client, sent, COMPLETION, KEY_B)
    assert salt_a and salt_b and salt_a != salt_b
    assert _salt(client, sent, CHAT, KEY_A, "/v1/chat/completions") == salt_a  # stable per key
    assert KEY_A not in salt_a and KEY_A[3:] not in salt_a  # nothing of the key itself
    # A client's own salt lands under its key's: B cannot name A's namespace, whatever it sends.
    assert _salt(client, sent, {**COMPLETION, "cache_salt": "x"}, KEY_A) == f"{salt_a}:x"
    assert _salt(client, sent, {**COMPLETION, "cache_salt": salt_a}, KEY_B) == f"{salt_b}:{salt_a}"
    assert client.post("/v1/completions", json=COMPLETION,
                       headers={"Authorization": "Bearer sk-nobody"}).status_code == 401
    # The longest client salt under the longest key salt still fits the engine's bound.
    assert len(_salt(client, sent, {**COMPLETION, "cache_salt": "s" * 256}, KEY_B)) <= 512


def test_without_the_option_keys_share_one_namespace(sent):
    with _client(api_key=KEY_A, api_keys=(KEY_B,)) as client:
        assert _salt(client, sent, COMPLETION, KEY_A) is None
        assert _salt(client, sent, COMPLETION, KEY_B) is None
        assert _salt(client, sent, {**COMPLETION, "cache_salt": "x"}, KEY_B) == "x"


def test_per_key_salts_need_keys():
    with pytest.raises(ValueError, match="API keys"):
        Limits(api_key_cache_salt=True)
    with pytest.raises(ValueError, match="api_keys"):
        Limits(api_key=KEY_A, api_keys=("",))
