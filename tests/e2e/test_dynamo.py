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

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.helpers import BIN

pytestmark = pytest.mark.e2e

MODEL = "tiny"
MAX_TOKENS = 12
PROMPTS = ["Hello world", "The quick brown fox", "Café au lait", "Stop strings end a request;"]


def _free_port() -> int:
    """A free loopback port below 32768 (Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an i16)."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below 32768")


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


@dataclass
class Proc:
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Worker(Proc):
    system_port: int

    def metric(self, name: str, endpoint: str = "generate") -> float:
        for line in _get(f"http://127.0.0.1:{self.system_port}/metrics").splitlines():
            if line.startswith(name + "{") and f'dynamo_endpoint="{endpoint}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    @property
    def requests(self) -> int:
        return int(self.metric("dynamo_component_requests_total"))

    @property
    def cache_usage(self) -> float:
        return self.metric("dynamo_component_gpu_cache_usage_percent")


@dataclass
class Fleet:
    kv_url: str
    """OpenAI base URL of the KV-routing frontend."""
    rr_url: str
    """OpenAI base URL of the round-robin frontend (same workers)."""
    workers: list[Worker]
    expected: dict[str, str]


def _env(root: Path, **extra: str) -> dict[str, str]:
    loopback = {k: "127.0.0.1" for k in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
                                          "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST")}
    return {**os.environ, "DYN_FILE_KV": str(root / "discovery"), "PYTHONUNBUFFERED": "1",
            "DYN_LOG": "warn", **loopback, **extra}


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def fleet(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamo")
    (root / "discovery").mkdir()
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    procs: list[Proc] = []
    try:
        workers = []
        for i in range(2):
            port = _free_port()
            log = root / f"worker{i}.log"
            # Small prefill chunks: a long prompt's prefill takes many steps, so a cached one is
            # clearly faster (the time-to-first-token check below).
            cmd = [str(BIN / "trtforge"), "dynamo-worker", str(engine_dir), "--served-model-name", MODEL,
                   "--schedule", "prefill_chunk_size=64", *planes]
            w = Worker(_start(cmd, log, _env(root, DYN_SYSTEM_PORT=str(port))), log, port)
            procs.append(w)
            workers.append(w)
        urls = []
        for mode in ("kv", "round-robin"):
            port = _free_port()
            log = root / f"frontend-{mode}.log"
            cmd = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                   "--router-mode", mode, *planes]
            procs.append(Proc(_start(cmd, log, _env(root)), log))
            urls.append(f"http://127.0.0.1:{port}/v1")

        def ready() -> bool:
            for p in procs:
                if p.proc.poll() is not None:
                    raise AssertionError(f"{p.log.name} exited {p.proc.returncode}:\n{p.log.read_text()[-3000:]}")
            try:
                return all(MODEL in _get(u + "/models") for u in urls) and \
                    all(_get(f"http://127.0.0.1:{w.system_port}/metrics") for w in workers)
            except OSError:
                return False

        _wait(ready, 180, "the frontends list the model and both workers answer")
        from trtforge.config.sampling import SamplingParams
        from trtforge.serving.engine import LLMEngine

        engine = LLMEngine.from_engine_dir(engine_dir)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        expected = {p: o.text for p, o in zip(PROMPTS, outs)}
        client = _client(urls[0])
        # Both workers registered with the router: requests reach both (a handful, by load).
        _wait(lambda: _spread(client, workers), 60, "both workers serve requests")
        yield Fleet(urls[0], urls[1], workers, expected)
    finally:
        for p in procs:
            p.stop()


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def _complete(client, prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> str:
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       extra_body={"ignore_eos": True, **extra})
    return answer.choices[0].text


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
    # Concurrent requests across both workers: each still the engine's own text.
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda i: _complete(client, PROMPTS[i % 4]), range(32)))
    assert texts == [fleet.expected[PROMPTS[i % 4]] for i in range(32)]
    _wait(lambda: _idle(fleet), 10, "no KV block held after the requests")


def test_a_cancelled_stream_frees_its_blocks_and_bad_requests_fail_alone(fleet):
    client = _client(fleet.kv_url)
    stream = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    # The request holds blocks (the load snapshot is published at most every 50 ms: wait for it).
    _wait(lambda: any(w.cache_usage > 0 for w in fleet.workers), 5, "the running request's blocks show")
    stream.close()
    _wait(lambda: _idle(fleet), 10, "the cancelled request's blocks are freed")
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
    _wait(lambda: _idle(fleet), 10, "no block held after the bad requests")


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
    _wait(lambda: _idle(fleet), 10, "no block held")


# Dynamo's transport logs at ERROR when the peer of a stream has gone away: the cancelled stream
# above closes its connection while the worker still writes to it ("writer task returned error ...
# Broken pipe"). That line is the runtime reporting the cancellation, not a failure of ours.
_TRANSPORT_CANCEL = re.compile(r"dynamo_runtime::pipeline::network::tcp::client.*(Broken pipe|Connection reset)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_worker_logs_show_no_errors(fleet):
    for w in fleet.workers:
        text = _ANSI.sub("", w.log.read_text())
        assert "Traceback" not in text, text[-3000:]
        errors = [line for line in text.splitlines() if re.search(r"\bERROR\b", line)
                  and not _TRANSPORT_CANCEL.search(line)]
        assert not errors, errors
