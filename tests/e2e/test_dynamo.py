"""trtforge behind NVIDIA Dynamo on loopback: Dynamo's OpenAI frontend (`python -m dynamo.frontend`,
its Rust router and tokenizer) in front of two `trtforge dynamo-worker` processes, file
discovery, TCP request plane, ZMQ event plane; nothing else installed or running.

Oracles: the in-process engine (what `trtforge generate` runs) for the text, each worker's own
Dynamo metrics (`dynamo_component_requests_total`, fed by the worker runtime) for where a request
went, and the load snapshot our workers publish (`dynamo_component_gpu_cache_usage_percent`) for
KV blocks held. The KV-aware router only knows what a worker holds from our KV events, so
"repeats go to the worker that served the prompt" tests those events; a second frontend in
round-robin mode over the same workers is the control. The count of tests here is checked in
conftest.EXPECTED_TESTS.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
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
class Fleet:
    kv_url: str
    """OpenAI base URL of the KV-routing frontend."""
    rr_url: str
    """OpenAI base URL of the round-robin frontend (same workers)."""
    workers: list[Worker]
    expected: dict[str, str]
    root: Path
    """The fleet's folder (discovery, logs)."""
    tokenizer: object
    vocab_size: int
    kv_tokens: int
    """Tokens a worker's KV pool holds (blocks x block size)."""


@pytest.fixture(scope="module")
def fleet(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamo")
    (root / "discovery").mkdir()
    procs: list[Proc] = []
    try:
        # Small prefill chunks: a long prompt's prefill takes many steps, so a cached one is
        # clearly faster (the time-to-first-token check below).
        workers = [start_worker(root, engine_dir, f"worker{i}", "--schedule", "prefill_chunk_size=64")
                   for i in range(2)]
        procs += workers
        urls = []
        for mode in ("kv", "round-robin"):
            frontend, url = start_frontend(root, mode)
            procs.append(frontend)
            urls.append(url)
        wait_ready(procs, urls, workers)
        engine, expected = oracle(engine_dir)
        c = _client(urls[0])
        # Both workers registered with the router: requests reach both (a handful, by load).
        wait(lambda: _spread(c, workers), 60, "both workers serve requests")
        yield Fleet(urls[0], urls[1], workers, expected, root, engine.tokenizer,
                    engine.engine_config.model.vocab_size,
                    engine.scheduler_config.num_blocks * engine.scheduler_config.block_size)
    finally:
        for p in procs:
            p.stop()


def _client(url: str):
    return client(url)


def _complete(c, prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> str:
    return complete(c, prompt, max_tokens, **extra)


def _spread(client, workers) -> bool:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _complete(client, f"{i} warm-up {i}", 2), range(16)))
    return all(w.requests for w in workers)


def _idle(fleet: Fleet) -> bool:
    return all(w.cache_usage == 0 for w in fleet.workers)


def test_openai_sdk_completions_and_streams_equal_trtforge_generate(fleet):
    client = _client(fleet.kv_url)
    for prompt in PROMPTS:
        assert _complete(client, prompt) == fleet.expected[prompt]
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        pieces = [c.choices[0].text for c in stream if c.choices]
        assert "".join(pieces) == fleet.expected[prompt] and len([p for p in pieces if p]) > 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    # Structured output through Dynamo's guided_decoding (random weights, sampled: only the
    # grammar keeps these valid).
    for extra, valid in [({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
                         ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no"))]:
        for seed in range(3):
            text = client.completions.create(model=MODEL, prompt="pick", max_tokens=10, temperature=1.0,
                                             seed=seed, extra_body=extra).choices[0].text
            assert valid(text), (extra, text)
    # Concurrent requests across both workers: each still the engine's own text.
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda i: _complete(client, PROMPTS[i % 4]), range(32)))
    assert texts == [fleet.expected[PROMPTS[i % 4]] for i in range(32)]
    wait(lambda: _idle(fleet), 10, "no KV block held after the requests")


def test_a_cancelled_stream_frees_its_blocks_and_bad_requests_fail_alone(fleet):
    client = _client(fleet.kv_url)
    stream = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    # The request holds blocks (the load snapshot is published at most every 50 ms: wait for it).
    wait(lambda: any(w.cache_usage > 0 for w in fleet.workers), 5, "the running request's blocks show")
    stream.close()
    wait(lambda: _idle(fleet), 10, "the cancelled request's blocks are freed")
    import openai

    bad = [dict(max_tokens=10 ** 6), dict(extra_body={"ignore_eos": True, "min_tokens": -1}),
           dict(extra_body={"ignore_eos": True, "repetition_penalty": -1.0})]
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(_complete, client, p) for p in PROMPTS]
        failed = [pool.submit(lambda kw=kw: client.completions.create(model=MODEL, prompt="hi", **{
            "max_tokens": 4, **kw})) for kw in bad]
        for f in failed:
            with pytest.raises(openai.APIStatusError) as info:
                f.result()
            assert 400 <= info.value.status_code < 600
        assert [f.result() for f in good] == [fleet.expected[p] for p in PROMPTS]
    wait(lambda: _idle(fleet), 10, "no block held after the bad requests")


def _ttft(client, prompt: str) -> float:
    start = time.perf_counter()
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            elapsed = time.perf_counter() - start
            stream.close()
            return elapsed
    raise AssertionError("no token")


def test_kv_aware_routing_follows_our_kv_events(fleet):
    """A long prompt served by one worker: its repeats, and longer prompts that share it, go to that
    worker (the router learned its blocks from our events) and start much sooner than a cold
    prefill; the round-robin frontend over the same workers spreads them."""
    kv, rr = _client(fleet.kv_url), _client(fleet.rr_url)
    words = " ".join(f"w{i}" for i in range(300))  # ~1,150 tokens: 18 prefill steps of 64
    prefix = f"{os.urandom(4).hex()} {words}"
    before = [w.requests for w in fleet.workers]
    cold = _ttft(kv, prefix)
    holder = max(range(2), key=lambda i: fleet.workers[i].requests - before[i])
    counts = [w.requests for w in fleet.workers]
    warm = []
    for i in range(20):
        prompt = prefix if i % 2 == 0 else f"{prefix} and then {i}"
        warm.append(_ttft(kv, prompt))
    served = [w.requests - c for w, c in zip(fleet.workers, counts)]
    median = sorted(warm)[len(warm) // 2]
    print(f"\nkv routing: cold TTFT {1e3 * cold:.1f} ms, repeats' median {1e3 * median:.1f} ms "
          f"({median / cold:.2f}x); repeats per worker {served} (prefix on worker {holder})")
    assert served[holder] >= 18, served  # >= 90 % to the worker holding the prefix
    assert median <= 0.3 * cold, (cold, warm)
    # Round-robin over the same workers: the same prompts alternate between them.
    counts = [w.requests for w in fleet.workers]
    for i in range(20):
        _ttft(rr, f"{prefix} and then {i}")
    served = [w.requests - c for w, c in zip(fleet.workers, counts)]
    print(f"round-robin: the same prompts per worker {served}")
    assert min(served) >= 6, served
    wait(lambda: _idle(fleet), 10, "no block held")


def _cached_tokens(c, prompt: str) -> int:
    """The engine's count of prompt tokens it served from its prefix cache (usage)."""
    answer = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    details = answer.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else -1


async def _until(probe, predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate(value := await probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} (last: {value})")
        await asyncio.sleep(0.2)
    return value


def test_evicted_blocks_leave_the_router(fleet):
    """Our removed-block events: once the worker holding a prompt's blocks evicts them, a KV router
    no longer credits it with them (and a repeat is computed again: no cached prompt tokens). The
    router is Dynamo's own KvRouter in this process, fed only by the workers' KV events."""
    from dynamo._core import KvRouter, KvRouterConfig

    prefix = f"{os.urandom(4).hex()} " + " ".join(f"e{i}" for i in range(200))
    ids = fleet.tokenizer.encode(prefix, add_special_tokens=False)
    kv = _client(fleet.kv_url)
    vocab = fleet.vocab_size
    # Other prompts that overfill a worker's KV pool (every block of it is reused).
    others = [[(17 * i + 7 * j) % (vocab - 10) + 5 for j in range(1000)]
              for i in range(1, fleet.kv_tokens // 1000 + 4)]

    async def scenario(runtime):
        endpoint = runtime.endpoint("dynamo.trtforge.generate")
        router = KvRouter(endpoint, 8, KvRouterConfig())
        workers = await endpoint.client()
        await workers.wait_for_instances()

        async def overlap() -> dict[int, int]:
            rows = (await router.get_overlap_scores(ids))["workers"]
            return {r["worker_id"]: r["device_blocks"] for r in rows}

        first = await asyncio.to_thread(_cached_tokens, kv, prefix)
        learned = await _until(overlap, lambda o: max(o.values(), default=0) >= len(ids) // 8 - 1, 20,
                               "the router learns the prompt's blocks from our stored events")
        holder = max(learned, key=learned.get)
        hit = await asyncio.to_thread(_cached_tokens, kv, prefix)  # routed to the holder: its cache
        for other in others:  # straight to the holder's endpoint: every eviction is a removed event
            await collect(workers.direct({"token_ids": other, "stop_conditions": {"max_tokens": 1},
                                          "sampling_options": {"temperature": 0.0}}, holder))
        forgotten = await _until(overlap, lambda o: o.get(holder, 0) == 0, 20,
                                 "the evicted blocks leave the router")
        miss = await asyncio.to_thread(_cached_tokens, kv, prefix)  # nobody holds it: computed again
        return first, learned, hit, forgotten, miss

    first, learned, hit, forgotten, miss = in_runtime(fleet.root, scenario)
    print(f"\neviction: router overlap {learned} -> {forgotten}; cached prompt tokens of a repeat "
          f"{hit} before, {miss} after (prompt {len(ids)} tokens)")
    assert first == 0 and sorted(learned.values())[0] == 0, (first, learned)  # one worker holds it
    assert hit >= len(ids) - 8, (hit, len(ids))
    assert miss == 0 and not any(forgotten.values()), (miss, forgotten)
    wait(lambda: _idle(fleet), 10, "no block held")


def test_worker_logs_show_no_errors(fleet):
    for w in fleet.workers:
        assert not w.errors(), w.errors()


def test_a_dead_worker_fails_only_its_requests(fleet):
    """SIGKILL one worker while both stream: its streams end with an error, the other worker's
    finish exactly, and the frontend then serves everything from the survivor. (Last: it kills a
    worker of the module's fleet.)"""
    import openai

    kv = _client(fleet.kv_url)
    victim, survivor = fleet.workers
    results: dict[int, object] = {}

    def stream(i: int) -> None:
        try:
            s = kv.completions.create(model=MODEL, prompt=f"{i} {PROMPTS[i % 4]}", max_tokens=400,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
            reasons = [ch.choices[0].finish_reason for ch in s if ch.choices and ch.choices[0].finish_reason]
            results[i] = reasons[-1] if reasons else "no finish_reason"
        except openai.APIError as exc:
            results[i] = exc

    before = [w.requests for w in fleet.workers]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        wait(lambda: all(w.requests > b for w, b in zip(fleet.workers, before)), 30,
             "both workers stream")
        wait(lambda: victim.cache_usage > 0 and survivor.cache_usage > 0, 10, "both hold KV")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        for f in futures:
            f.result()
    outcome = [type(r).__name__ if isinstance(r, BaseException) else r for r in results.values()]
    print(f"\ndead worker: the 8 streams ended {outcome}")
    # The survivor's streams complete; the victim's fail (an error, never a silent "length").
    assert 1 <= outcome.count("length") < 8, outcome
    # Afterwards every request is served, exactly, by the survivor.
    wait(lambda: _all_served(kv, fleet), 60, "the frontend drops the dead worker")
    wait(lambda: survivor.cache_usage == 0, 10, "the survivor holds no block")


def _all_served(kv, fleet: Fleet) -> bool:
    import openai

    try:
        return all(_complete(kv, p) == fleet.expected[p] for p in PROMPTS)
    except openai.APIError:
        return False
