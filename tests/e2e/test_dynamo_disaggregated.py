"""Disaggregated prefill/decode through NVIDIA Dynamo on loopback: Dynamo's frontend routes each
request to a `trtforge dynamo-worker --disaggregation-mode prefill` worker, then hands its
`disaggregated_params` (our signed KV handle) to a `--disaggregation-mode decode` worker, which
imports the prompt's KV through our connector (shared memory, and TCP with the handoff key as
between hosts) and streams the answer.

Oracles: the co-located engine's greedy text (what `trtforge generate` prints); each worker's
Dynamo request counter (both phases served every request); and an attacker with a Dynamo runtime
of their own, who calls the decode worker's endpoint directly with forged, replayed and foreign
handles beside good requests that must stay exact. The count of tests here is checked in
conftest.EXPECTED_TESTS.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.dynamo_fleet import (
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    Proc,
    Worker,
    client,
    collect,
    complete,
    in_runtime,
    oracle,
    start_frontend,
    start_worker,
    wait,
    wait_ready,
)

pytestmark = pytest.mark.e2e



@dataclass
class DisaggFleet:
    url: str
    prefill: Worker
    decode: Worker
    root: Path
    expected: dict[str, str]
    tokenizer: object


@pytest.fixture(scope="module", params=["shm", "tcp"])
def disagg(request, engine_dir, tmp_path_factory):
    """shm: the handoff through shared memory (one host); tcp: through the TCP connector with the
    shared handoff key, as between hosts (on loopback here)."""
    root = tmp_path_factory.mktemp(f"dynamo-disagg-{request.param}")
    (root / "discovery").mkdir()
    connector: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    if request.param == "tcp":
        key = root / "kv.key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        connector = (("--kv-connector", "tcp://127.0.0.1:0", "--kv-auth-key-file", str(key)),
                     ("--kv-auth-key-file", str(key), "--kv-peers", "127.0.0.1"))
    procs: list[Proc] = []
    try:
        prefill = start_worker(root, engine_dir, "prefill", "--disaggregation-mode", "prefill",
                               "--component", "prefill", *connector[0])
        decode = start_worker(root, engine_dir, "decode", "--disaggregation-mode", "decode", *connector[1])
        frontend, url = start_frontend(root, "kv")
        procs += [prefill, decode, frontend]
        wait_ready(procs, [url], [prefill, decode])
        engine, expected = oracle(engine_dir)
        c = client(url)
        # The frontend serves once it knows both roles (a 503 "not ready" until then).
        wait(lambda: _served(c), 60, "the frontend routes prefill then decode")
        yield DisaggFleet(url, prefill, decode, root, expected,
                          engine.tokenizer)
    finally:
        for p in procs:
            p.stop()


def _served(c) -> bool:
    import openai

    try:
        return bool(complete(c, "warm up", 2))
    except openai.APIStatusError:
        return False


def test_prefill_and_decode_workers_give_the_colocated_text(disagg):
    c = client(disagg.url)
    before = (disagg.prefill.requests, disagg.decode.requests)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: complete(c, PROMPTS[i % 4], MAX_TOKENS), range(16)))
    assert texts == [disagg.expected[PROMPTS[i % 4]] for i in range(16)]
    stream = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == disagg.expected[PROMPTS[1]]
    # Every request went through both roles: prefill there, decode from the imported KV here.
    assert disagg.prefill.requests - before[0] >= 17 and disagg.decode.requests - before[1] >= 17
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4, temperature=0)
    assert chat.usage.completion_tokens >= 1
    wait(lambda: disagg.decode.cache_usage == 0, 10, "the decode worker holds no block after")


_REQUEST = {"model": MODEL, "stop_conditions": {"max_tokens": MAX_TOKENS, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0}, "output_options": {}, "eos_token_ids": []}


def test_forged_replayed_and_foreign_handoffs_fail_alone(disagg):
    """An attacker on the request plane calls the decode worker directly: a handle with altered
    blocks, one replayed after its use, one of another prompt, none at all — each refused by name
    while good requests through the frontend stay exact."""
    ids = disagg.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    request = {**_REQUEST, "token_ids": ids}

    async def attack(runtime):
        prefill = await runtime.endpoint("dynamo.prefill.generate").client()
        decode = await runtime.endpoint("dynamo.trtforge.generate").client()
        await prefill.wait_for_instances()
        await decode.wait_for_instances()
        staged = await collect(prefill.round_robin({**request, "stop_conditions": {"max_tokens": 1}}))
        params = staged[-1]["disaggregated_params"]
        handle = json.loads(params["trtforge_kv_handle"])
        outcomes = {}
        for name, params_sent, token_ids in [
                ("forged", {"trtforge_kv_handle": json.dumps({**handle, "blocks": [0, 1, 2]})}, ids),
                ("foreign prompt", params, [t + 1 for t in ids]),
                ("no handle", None, ids),
                ("good", params, ids),
                ("replayed", params, ids)]:
            req = {**request, "token_ids": token_ids}
            if params_sent is not None:
                req["prefill_result"] = {"disaggregated_params": params_sent}
            try:
                chunks = await collect(decode.round_robin(req))
                outcomes[name] = [t for ch in chunks for t in ch.get("token_ids") or []]
            except Exception as exc:  # noqa: BLE001 - Dynamo's InvalidArgument: what is checked
                outcomes[name] = f"{type(exc).__name__}: {exc}"
        return outcomes

    c = client(disagg.url)
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(complete, c, p, MAX_TOKENS) for p in PROMPTS]
        outcomes = in_runtime(disagg.root, attack)
        assert [f.result() for f in good] == [disagg.expected[p] for p in PROMPTS]
    assert disagg.tokenizer.decode(outcomes["good"]) == disagg.expected[PROMPTS[0]], outcomes
    for name, reason in [("forged", "not authenticated"), ("foreign prompt", "another prompt"),
                         ("no handle", "prefill_result"), ("replayed", "already used")]:
        assert isinstance(outcomes[name], str) and "InvalidArgument" in outcomes[name] \
            and reason in outcomes[name], (name, outcomes[name])
    wait(lambda: disagg.decode.cache_usage == 0, 10, "no block held after the attack")
    assert not disagg.decode.errors() and not disagg.prefill.errors(), \
        (disagg.decode.errors(), disagg.prefill.errors())
