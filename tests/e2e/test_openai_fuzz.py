"""Fuzz the OpenAI-compatible endpoint from its own OpenAPI schema (schemathesis + hypothesis).

Requests are generated from the `/openapi.json` the server publishes, both valid ones
(schemathesis' positive mode) and ones that break the schema (negative mode: wrong types,
missing fields, garbage bodies), and sent to a real `trtforge serve` on the tiny e2e engine. No
answer may be a 5xx, every error must be an OpenAI error object, every 200 stream must end with
[DONE]; afterwards the server must still be ready, answer correctly and hold no KV block.

To keep the run to about two minutes the schema is narrowed before generation: the model id is
the served one (otherwise nearly every request would be a 404), token limits are at most 8 (and
chat requests carry one), texts are short. The count of tests here is checked in conftest.EXPECTED_TESTS.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.e2e.helpers import run_cli
from tests.e2e.openai_server import start_serve, wait_for

pytestmark = pytest.mark.e2e

REQUESTS = 500
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
              ("/v1/models/{model}", "GET"), ("/v1/models", "GET"), ("/health", "GET")]


@pytest.fixture(scope="module")
def serve(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("openai-fuzz")
    run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "repo"))
    process = start_serve(root / "repo", root / "tritonserver.log")
    try:
        yield process
    finally:
        assert process.stop() == 0, "".join(process.output)


def _narrow(node: object, model: str) -> object:
    """The schema with the served model id, token limits <= 8, strings and lists short."""
    if isinstance(node, list):
        return [_narrow(item, model) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _narrow(value, model) for key, value in node.items()}
    properties = node.get("properties", {})
    if "model" in properties and properties["model"].get("type") == "string":
        properties["model"] = {"type": "string", "enum": [model]}
    for name in ("max_tokens", "max_completion_tokens"):
        for option in properties.get(name, {}).get("anyOf", []):
            if option.get("type") == "integer":
                option["maximum"] = 8
    if "max_completion_tokens" in properties:  # else a chat reply may fill the context (~1 s)
        node["required"] = [*node.get("required", []), "max_completion_tokens"]
        properties["max_completion_tokens"] = properties["max_completion_tokens"]["anyOf"][0]
    if node.get("type") == "string" and "enum" not in node and "const" not in node:
        node["maxLength"] = min(node.get("maxLength", 24), 24)
    if node.get("type") == "array":
        node["maxItems"] = min(node.get("maxItems", 4), 4)
    return node


def _check(response, sent: dict) -> None:
    assert response.status_code < 500, (sent, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], (sent, response.text)
    elif "text/event-stream" in str(response.headers.get("content-type")):
        # An accepted stream has started generating: it must end well, not with an error.
        events = [event.removeprefix("data: ") for event in response.text.split("\n\n") if event]
        assert events[-1] == "[DONE]", (sent, events[-3:])
        assert all("error" not in json.loads(event) for event in events[:-1]), (sent, events)


def test_500_schema_generated_requests_no_5xx_and_nothing_leaks(serve):
    root = serve.openai_url.removesuffix("/v1")
    spec = json.loads(urllib.request.urlopen(root + "/openapi.json", timeout=30).read())
    model = json.loads(urllib.request.urlopen(root + "/v1/models", timeout=30).read())
    name = model["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(_narrow(copy.deepcopy(spec), name))
    strategies = [schema[path][method].as_strategy(generation_mode=mode)
                  for path, method in OPERATIONS
                  for mode in (schemathesis.GenerationMode.POSITIVE,
                               schemathesis.GenerationMode.NEGATIVE)]
    sent: list[int] = []

    @settings(max_examples=REQUESTS + 20, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies))
    def fuzz(case) -> None:
        response = case.call(base_url=root, timeout=60)
        sent.append(response.status_code)
        _check(response, {"path": case.path, "body": repr(case.body)[:500]})

    fuzz()
    print("fuzz statuses:", sorted(Counter(sent).items()))
    assert len(sent) >= REQUESTS
    assert sent.count(200) > REQUESTS / 10, sorted(set(sent))  # not all refused
    assert urllib.request.urlopen(root + "/health", timeout=30).status == 200
    assert wait_for(lambda: serve.metric("trtforge_requests_running") == 0, 60)
    assert wait_for(lambda: serve.metric("trtforge_kv_blocks_used") == 0, 30)
    request = urllib.request.Request(root + "/v1/completions", headers={
        "Content-Type": "application/json"}, data=json.dumps(
        {"model": name, "prompt": "Hello world", "max_tokens": 4, "temperature": 0}).encode())
    answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert answer["usage"]["completion_tokens"] == 4
