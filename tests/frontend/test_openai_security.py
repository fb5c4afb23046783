"""What the OpenAI-compatible API refuses and hides, attacked through the real app (FastAPI's
TestClient, or uvicorn on loopback) in front of a scripted Triton bridge: the API key, the body
and prompt caps (checked before parsing / tokenizing), generic 5xx bodies, the loopback default,
and chat templates run off the event loop."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from tests.frontend.stub_bridge import StubBridge
from tests.helpers.checkpoints import tokenizer as tiny_tokenizer
from trtforge.cli.triton import serve_command
from trtforge.frontend import guard, server
from trtforge.frontend.errors import INTERNAL_ERROR
from trtforge.frontend.guard import Limits
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.service import OpenAIFrontend
from trtforge.frontend.triton_bridge import Piece, error_for_message
from trtforge.model_repo.request import parse_request

KEY = "sk-test-0123456789"
REPLY = ["Hel", "lo", " there"]
SECRET = "secret-internal-detail /opt/trtforge/engine.py"


class SpyTokenizer:
    """The tiny tokenizer, counting the calls that tokenize or template (and slow on demand)."""

    def __init__(self, template_cpu_s: float = 0.0) -> None:
        self.tok = tiny_tokenizer()
        self.chat_template = self.tok.chat_template
        self.calls = 0
        self.template_cpu_s = template_cpu_s
        self.template_threads: list[str] = []

    def encode(self, text: str, **kwargs) -> list[int]:
        self.calls += 1
        return self.tok.encode(text, **kwargs)

    def apply_chat_template(self, conversation, **kwargs) -> str:
        self.calls += 1
        self.template_threads.append(threading.current_thread().name)
        end = time.thread_time() + self.template_cpu_s
        while time.thread_time() < end:  # a slow template: Python work, holding the GIL
            sum(range(1000))
        return self.tok.apply_chat_template(conversation, **kwargs)


class FakeBridge(StubBridge):
    """TritonBridge's interface; the prompt chooses what the "model" does."""

    prompts: list[str] = []
    stream_pieces = 150
    """The prompt "stream" gets this many pieces, one every 20 ms; the others get REPLY."""

    async def generate(self, arrays):
        prompt = parse_request(arrays).prompt  # (a chat prompt holds the message's text)
        FakeBridge.prompts.append(prompt)
        if "boom" in prompt and "boom-later" not in prompt:
            raise RuntimeError(SECRET)
        if "triton-error" in prompt:
            raise error_for_message(f"engine step failed: {SECRET}")
        if "server-busy" in prompt:
            raise error_for_message(f"server busy, retry later: {SECRET}")
        pieces = [f"w{i} " for i in range(self.stream_pieces)] if prompt == "stream" else REPLY
        for i, text in enumerate(pieces):
            await asyncio.sleep(0.02 if prompt == "stream" else 0)
            if prompt == "boom-later" and i == 1:
                raise RuntimeError(SECRET)
            final = i == len(pieces) - 1
            yield Piece(text, [-0.5], final, num_input_tokens=2 if final else None,
                        num_output_tokens=len(pieces) if final else None,
                        finish_reason="stop" if final else None)


@pytest.fixture
def bridge(monkeypatch):
    monkeypatch.setattr(server, "TritonBridge", FakeBridge)
    monkeypatch.setattr(FakeBridge, "prompts", [])
    return FakeBridge


def _served(tok=None, max_seq_len: int = 64) -> ServedModel:
    return ServedModel(name="tiny", engine_dir=Path("/nonexistent"), tokenizer=tok or SpyTokenizer(),
                       max_seq_len=max_seq_len)


def _client(served: ServedModel | None = None, **limits) -> TestClient:
    app = server.create_app(served or _served(), "127.0.0.1:1", Limits(**limits))
    return TestClient(app, raise_server_exceptions=False)


COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def _error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


def test_api_key_is_required_on_every_route_but_health(bridge):
    served = _served()
    with _client(served, api_key=KEY) as client:
        routes = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
                  ("POST", "/v1/completions", COMPLETION), ("POST", "/v1/chat/completions", CHAT),
                  ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/nope", None)]
        refused = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                   {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
                   {"Authorization": "Bearer"}, {"Authorization": KEY}, {"X-Api-Key": KEY}]
        for method, path, body in routes:
            for headers in refused:
                response = client.request(method, path, json=body, headers=headers)
                error = _error(response, 401, "invalid_api_key")
                assert response.headers["www-authenticate"] == "Bearer"
                assert KEY not in response.text and "Authorization: Bearer KEY" in error["message"]
        # Refused before the body is read: invalid JSON, or a body over the cap, still 401.
        assert client.post("/v1/completions", content=b"{nope").status_code == 401
        assert client.post("/v1/completions", content=b"x" * (8 << 20)).status_code == 401
        assert bridge.prompts == [] and served.tokenizer.calls == 0
        assert client.get("/health").json() == {"status": "ok"}  # probes carry no key
        good = {"Authorization": f"Bearer {KEY}"}
        answer = client.post("/v1/completions", json=COMPLETION, headers=good).json()
        assert answer["choices"][0]["text"] == "Hello there"
        chat = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"bearer {KEY}"})
        assert chat.json()["choices"][0]["message"]["content"] == "Hello there"
        assert client.get("/v1/models", headers=good).json()["data"][0]["id"] == "tiny"
        assert bridge.prompts[0] == "Hi" and len(bridge.prompts) == 2


def test_the_key_is_compared_in_constant_time(bridge, monkeypatch):
    compared = []

    def spy(a, b):
        compared.append((len(a), len(b)))
        return a == b

    monkeypatch.setattr(guard.hmac, "compare_digest", spy)
    with _client(api_key=KEY) as client:
        client.get("/v1/models", headers={"Authorization": "Bearer x"})
        client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert compared == [(32, 32), (32, 32)]  # digests: the key's length does not show either


def test_no_key_means_open_and_an_empty_key_is_refused(bridge):
    with _client() as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    with pytest.raises(ValueError, match="empty"):
        Limits(api_key=" ")


def test_oversized_body_is_413_before_json_parsing(bridge):
    served = _served()
    with _client(served, max_request_bytes=1000) as client:
        for body in (b"{" + b" " * 1000 + b"}", b"not json at all" * 100):
            response = client.post("/v1/completions", content=body,
                                   headers={"Content-Type": "application/json"})
            error = _error(response, 413, "request_too_large")
            assert "1000 bytes" in error["message"] and "--max-request-bytes" in error["message"]
        # Without a Content-Length (chunked): counted while reading, refused the same.
        chunked = client.post("/v1/chat/completions", content=iter([b"[" * 600, b"]" * 600]),
                              headers={"Content-Type": "application/json"})
        _error(chunked, 413, "request_too_large")
        # At the cap: parsed and served.
        body = json.dumps({**COMPLETION, "user": ""}).encode()
        body = json.dumps({**COMPLETION, "user": "u" * (1000 - len(body))}).encode()
        assert len(body) == 1000
        assert client.post("/v1/completions", content=body,
                           headers={"Content-Type": "application/json"}).status_code == 200
    assert bridge.prompts == ["Hi"] and served.tokenizer.calls == 0


def test_refusals_reach_a_client_still_sending(bridge):
    """Over real sockets: a body over the cap (declared or chunked), or a keyless request with a
    big body, gets its 413 / 401 answer, not a connection reset while it is still sending (the
    rest of the body is read and dropped first, up to twice the cap)."""
    frontend = OpenAIFrontend("repo", "127.0.0.1", 0, None,
                              Limits(api_key=KEY, max_request_bytes=8 << 20))
    frontend.served = _served()
    frontend.start("127.0.0.1:1")
    port = frontend.server.addresses()[0][1]
    big = b"x" * ((16 << 20) - 1000)  # under twice the cap (drained), over the sockets' buffers
    try:
        for headers, body, status in [
                ({"Authorization": f"Bearer {KEY}"}, big, 413),
                ({"Authorization": f"Bearer {KEY}"}, iter([big[:1 << 20]] * 12), 413),  # chunked
                ({}, big, 401)]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/completions", body, {  # as urllib sends: uvicorn closes after
                "Content-Type": "application/json", "Connection": "close", **headers},  # the answer
                encode_chunked=not isinstance(body, bytes))
            response = conn.getresponse()
            assert response.status == status and json.loads(response.read())["error"]["code"] \
                == ("request_too_large" if status == 413 else "invalid_api_key")
            conn.close()
    finally:
        frontend.stop()


def test_oversized_prompt_is_400_before_tokenizing(bridge):
    served = _served()
    with _client(served, max_prompt_chars=100) as client:
        cases = [("/v1/completions", {**COMPLETION, "prompt": "x" * 101}, "prompt"),
                 ("/v1/completions", {**COMPLETION, "prompt": ["x" * 90], "stop": ["y" * 11]}, "prompt"),
                 ("/v1/chat/completions", {**CHAT, "messages": [
                     {"role": "system", "content": "s" * 50},
                     {"role": "user", "content": [{"type": "text", "text": "u" * 51}]}]}, "messages"),
                 ("/v1/chat/completions", {**CHAT, "messages": [
                     {"role": "user", "content": "u" * 60, "name": "n" * 41}]}, "messages")]
        for path, body, param in cases:
            for stream in (False, True):
                error = _error(client.post(path, json={**body, "stream": stream}), 400, "prompt_too_long")
                assert error["param"] == param and "at most 100" in error["message"]
                assert "--max-prompt-chars" in error["message"]
        assert bridge.prompts == [] and served.tokenizer.calls == 0  # nothing tokenized it
        ok = client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 100})
        assert ok.status_code == 200 and bridge.prompts == ["x" * 100]
    # The defaults follow the engine: 16 characters per token of max_seq_len, the body 6 bytes
    # per prompt character (at least 1 MiB).
    assert Limits().resolved(64) == Limits(max_prompt_chars=1024, max_request_bytes=1 << 20)
    assert Limits().resolved(1 << 17).max_request_bytes == 6 * 16 * (1 << 17)
    with _client(_served(max_seq_len=64)) as client:
        _error(client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 1025}), 400,
               "prompt_too_long")


def test_internal_errors_get_a_generic_500_and_go_to_the_log(bridge, caplog):
    caplog.set_level(logging.WARNING, logger="trtforge.frontend")
    with _client() as client:
        for path, body in [("/v1/completions", {**COMPLETION, "prompt": "boom"}),
                           ("/v1/completions", {**COMPLETION, "prompt": "triton-error"}),
                           ("/v1/completions", {**COMPLETION, "prompt": "boom", "stream": True}),
                           ("/v1/chat/completions", {**CHAT, "messages": [
                               {"role": "user", "content": "boom"}]})]:
            caplog.clear()
            response = client.post(path, json=body)
            error = _error(response, 500)
            request_id = response.headers["x-request-id"]
            assert error == {"message": f"{INTERNAL_ERROR} (request id {request_id}).",
                             "type": "server_error", "param": None, "code": None}
            assert "secret" not in response.text and "RuntimeError" not in response.text
            assert request_id in caplog.text and SECRET in caplog.text  # the operator's side
        # After the stream started: a generic error event, no exception text.
        caplog.clear()
        stream = client.post("/v1/completions", json={**COMPLETION, "prompt": "boom-later", "stream": True})
        assert stream.status_code == 200 and "secret" not in stream.text
        last = json.loads(stream.text.strip().split("\n\n")[-1].removeprefix("data: "))
        assert last["error"]["message"].startswith(INTERNAL_ERROR)
        assert stream.headers["x-request-id"] in caplog.text and SECRET in caplog.text
        # 503: the kind of trouble, not Triton's words.
        busy = _error(client.post("/v1/completions", json={**COMPLETION, "prompt": "server-busy"}),
                      503, "service_unavailable")
        assert "server busy" in busy["message"] and "secret" not in busy["message"]
        # A 4xx still says what was wrong.
        assert "n: Input should be less than or equal to 16" in _error(client.post("/v1/completions", json={
            **COMPLETION, "n": 17}), 400)["message"]
        assert "'other'" in _error(client.post("/v1/completions", json={
            **COMPLETION, "model": "other"}), 404, "model_not_found")["message"]


def test_every_answer_has_a_request_id(bridge):
    with _client(api_key=KEY) as client:
        ids = {client.get("/health").headers["x-request-id"],
               client.get("/v1/models").headers["x-request-id"]}
    assert len(ids) == 2 and all(i.startswith("req-") for i in ids)


def _wait_refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_the_default_bind_address_is_loopback(bridge):
    option = next(p for p in serve_command.params if p.name == "openai_host")
    assert option.default == "127.0.0.1"
    frontend = OpenAIFrontend("repo", option.default, 0, None)
    frontend.served = _served()
    banner = frontend.start("127.0.0.1:1")
    try:
        host, port = frontend.server.addresses()[0]
        assert banner.splitlines()[0] == f"OpenAI-compatible API: http://127.0.0.1:{port}/v1  model 'tiny'"
        assert "this machine only" in banner and "WARNING" not in banner
        assert {a[0] for a in frontend.server.addresses()} == {"127.0.0.1"}
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert _wait_refused("127.0.0.2", port)  # not listening on other addresses
    finally:
        frontend.stop()
    opened = OpenAIFrontend("repo", "0.0.0.0", 0, None)
    opened.served = _served()
    banner = opened.start("127.0.0.1:1")
    try:
        port = opened.server.addresses()[0][1]
        assert f"http://0.0.0.0:{port}/v1" in banner and "all interfaces" in banner
        assert "WARNING: without --api-key" in banner and f"curl http://127.0.0.1:{port}/" in banner
    finally:
        opened.stop()


def test_serve_options(tmp_path, monkeypatch):
    monkeypatch.setenv(guard.API_KEY_ENV, KEY)
    ctx = serve_command.make_context("serve", [str(tmp_path), "--openai-port", "0"])
    assert (ctx.params["api_key"], ctx.params["openai_host"]) == (KEY, "127.0.0.1")
    assert ctx.params["max_request_bytes"] is None and ctx.params["max_prompt_chars"] is None
    monkeypatch.delenv(guard.API_KEY_ENV)
    for extra in (["--api-key", KEY], ["--max-prompt-chars", "10"], ["--openai-host", "0.0.0.0"]):
        result = CliRunner().invoke(serve_command, [str(tmp_path), *extra])
        assert result.exit_code == 2 and "runs only with --openai-port" in result.output, result.output
    result = CliRunner().invoke(serve_command, [str(tmp_path), "--openai-port", "0",
                                                "--max-request-bytes", "0"])
    assert result.exit_code == 2 and "--max-request-bytes" in result.output


def test_serve_reads_tenant_keys_and_refuses_a_salt_without_keys(tmp_path, monkeypatch):
    from trtforge.cli.triton import _read_keys

    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-a\n\n  key-b  \n")
    assert _read_keys(str(keys)) == ("key-a", "key-b")
    ctx = serve_command.make_context("serve", [str(tmp_path), "--openai-port", "0", "--api-keys-file", str(keys),
                                               "--api-key-cache-salt"])
    assert ctx.params["api_key_cache_salt"] is True and ctx.params["api_keys_file"] == str(keys)
    result = CliRunner().invoke(serve_command, [str(tmp_path), "--api-key-cache-salt"])
    assert result.exit_code == 2 and "runs only with --openai-port" in result.output
    monkeypatch.delenv(guard.API_KEY_ENV, raising=False)
    result = CliRunner().invoke(serve_command, [str(tmp_path), "--openai-port", "0", "--api-key-cache-salt"])
    assert result.exit_code == 2 and "api_key_cache_salt" in result.output, result.output


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    """The tiny tokenizer as an engine directory loads it: models/tokenizer.PlainTokenizer."""
    from trtforge.models.tokenizer import PlainTokenizer, load_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer().save_pretrained(str(directory))
    tok = load_tokenizer(directory)
    assert isinstance(tok, PlainTokenizer)
    return tok


def test_counting_tokens_gives_the_engine_s_count(plain_tokenizer):
    for text in ("Hello world", "Café au lait " * 50, ""):
        assert _served(plain_tokenizer).count_tokens(text) \
            == len(plain_tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("case", ["slow chat template", "long prompt counted"])
def test_a_big_message_does_not_stall_other_streams(bridge, plain_tokenizer, case):
    """A big (allowed) chat message, sent while another request streams a piece every 20 ms:
    the stream's gaps stay small. Its chat template takes ~1.5 s of CPU (Python holding the GIL,
    as a slow jinja template), or, without max_tokens, its ~900,000 characters are counted
    (~1.5 s here; with tokenizers' `encode`, which holds the GIL, the stream stopped as long). On
    the event loop either would hold every stream for the whole time."""
    template = case == "slow chat template"
    tok = SpyTokenizer(template_cpu_s=1.5) if template else plain_tokenizer
    frontend = OpenAIFrontend("repo", "127.0.0.1", 0, None, Limits(max_prompt_chars=1 << 20))
    frontend.served = _served(tok)
    frontend.start("127.0.0.1:1")
    port = frontend.server.addresses()[0][1]
    arrivals: list[float] = []
    big: dict[str, float] = {}
    message = {"role": "user", "content": "hello " * (100_000 if template else 150_000)}
    body = {**CHAT, "messages": [message]} if template else {"model": "tiny", "messages": [message]}
    try:
        def stream() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps(
                {**COMPLETION, "prompt": "stream", "max_tokens": 150, "stream": True}),
                {"Content-Type": "application/json"})
            response = conn.getresponse()
            while line := response.readline():
                if line.startswith(b"data: "):
                    arrivals.append(time.monotonic())
            conn.close()

        streamer = threading.Thread(target=stream)
        streamer.start()
        deadline = time.monotonic() + 10
        while len(arrivals) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        big["start"] = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        big["end"] = time.monotonic()
        streamer.join(30)
    finally:
        frontend.stop()
    assert big["end"] - big["start"] >= (1.5 if template else 0.3)  # the work really ran that long
    if template:
        assert tok.template_threads and all(t.startswith("trtforge-tokenizer") for t in tok.template_threads)
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if big["start"] <= b <= big["end"]]
    assert len(arrivals) == 152 and len(during) > 10, (len(arrivals), len(during))
    assert max(during) < 0.5, sorted(during)[-5:]
