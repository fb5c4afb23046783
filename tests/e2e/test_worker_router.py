"""trtforge's router over co-located workers: two `trtforge serve` workers of a plain repository
("hosts" on loopback) behind a router server (`emit-repo --only router --worker-url …`) with the
OpenAI endpoint in front. Greedy answers equal the co-located engine's (gRPC streamed and not,
OpenAI); repeats of a prompt reach one worker and a new prompt the other (each worker's own engine
metrics say so); a cancelled stream frees its blocks on its worker; a worker killed mid-stream
fails only its own requests, naming it.

The count of tests here is checked in conftest.EXPECTED_TESTS; keep it in step.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.helpers import run_cli
from tests.e2e.openai_server import start_serve, wait_for
from tests.e2e.test_disaggregated_hosts import Server
from trtforge.model_repo import client

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello world", "The quick brown fox", "Café au lait"]
MAX_TOKENS = 12
LONG = "river stone lamp garden window paper engine signal harbor market winter copper " * 3
"""A prompt of several KV blocks (the e2e engine's blocks hold 8 tokens)."""
SURVIVOR = ("Another text entirely", 160)
"""The request on the worker that stays up while the other is killed: prompt, max_tokens."""


@pytest.fixture(scope="module")
def fleet(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("worker-router")
    run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "worker"))
    workers = [Server.start(root / "worker", root / f"worker{i}.log") for i in range(2)]
    router = None
    try:
        run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "router"), "--only", "router",
                *[x for w in workers for x in ("--worker-url", w.grpc)])
        router = start_serve(root / "router", root / "router.log")
        from trtforge.config.sampling import SamplingParams
        from trtforge.serving.engine import LLMEngine

        engine = LLMEngine.from_engine_dir(engine_dir)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        expected = {p: o.text for p, o in zip(PROMPTS, outs)}
        expected[SURVIVOR[0]] = engine.generate([SURVIVOR[0]], SamplingParams(max_tokens=SURVIVOR[1]))[0].text
        for w in workers:
            w.wait_ready()
        yield workers, router, expected, engine.scheduler_config.max_seq_len, engine_dir.resolve().name
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


def _counts(workers, name: str) -> list[float]:
    return [w.metric(name, "ensemble") for w in workers]


def test_answers_through_the_router_equal_the_colocated_engine(fleet):
    workers, router, expected, _, model = fleet

    def streamed(prompt: str) -> str:
        return "".join(client.stream_grpc(router.grpc_url, prompt, MAX_TOKENS))

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(streamed, PROMPTS * 3))
    assert answers == [expected[p] for p in PROMPTS * 3]
    for p in PROMPTS:  # not streamed: one answer, the prompt included (the default), as a worker's own
        whole = "".join(client.stream_grpc(router.grpc_url, p, MAX_TOKENS, stream=False))
        assert whole == p + expected[p] == "".join(client.stream_grpc(workers[0].grpc, p, MAX_TOKENS, stream=False))
    from openai import OpenAI

    api = OpenAI(base_url=router.openai_url, api_key="unused", max_retries=0)
    assert api.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                  temperature=0).choices[0].text == expected[PROMPTS[1]]
    assert sum(_counts(workers, "trtforge_prompt_tokens_total")) > 0 and all(
        n > 0 for n in _counts(workers, "trtforge_prompt_tokens_total"))  # both workers served some


def test_repeats_of_a_prompt_reach_one_worker_and_a_new_prompt_the_other(fleet):
    workers, router, *_ = fleet
    before = _counts(workers, "trtforge_prompt_tokens_total")
    hits = _counts(workers, "trtforge_prefix_cache_hits_total")
    for _ in range(3):
        "".join(client.stream_grpc(router.grpc_url, "[repeat] " + LONG, 4))
    grew = [a - b for a, b in zip(_counts(workers, "trtforge_prompt_tokens_total"), before)]
    assert sorted(g > 0 for g in grew) == [False, True], grew  # one worker had all three
    home = grew.index(max(grew))
    assert _counts(workers, "trtforge_prefix_cache_hits_total")[home] - hits[home] >= 2 * 8  # repeats hit
    before = _counts(workers, "trtforge_prompt_tokens_total")
    "".join(client.stream_grpc(router.grpc_url, "[other] " + LONG, 4))  # a prefix nobody holds
    grew = [a - b for a, b in zip(_counts(workers, "trtforge_prompt_tokens_total"), before)]
    assert grew[home] == 0 and grew[1 - home] > 0, grew  # the idle worker chosen least recently


def test_cancelled_stream_frees_its_blocks_on_the_worker(fleet):
    workers, router, _, max_seq_len, _ = fleet
    stream = client.stream_grpc(router.grpc_url, "Hello world", max_seq_len - 16)
    next(stream), next(stream), next(stream)
    running = _counts(workers, "trtforge_requests_running")
    assert sorted(running) == [0, 1], running
    worker = workers[running.index(1)]
    assert worker.metric("trtforge_kv_blocks_used", "ensemble") > 0
    generated = worker.metric("trtforge_generation_tokens_total", "ensemble")
    stream.close()  # the client cancels: the router cancels its stream to the worker
    assert wait_for(lambda: worker.metric("trtforge_kv_blocks_used", "ensemble") == 0)
    assert worker.metric("trtforge_requests_running", "ensemble") == 0
    assert worker.metric("trtforge_generation_tokens_total", "ensemble") - generated < (max_seq_len - 16) / 2


def test_a_killed_worker_fails_only_its_requests(fleet):
    workers, router, expected, max_seq_len, _ = fleet
    doomed = client.stream_grpc(router.grpc_url, "Hello world", max_seq_len - 16)
    next(doomed), next(doomed), next(doomed)
    running = _counts(workers, "trtforge_requests_running")
    victim, survivor = (workers[0], workers[1]) if running == [1, 0] else (workers[1], workers[0])
    assert sorted(running) == [0, 1], running
    before = survivor.metric("trtforge_prompt_tokens_total", "ensemble")
    with ThreadPoolExecutor(1) as pool:
        # the other worker has fewer requests in flight: it gets this one
        survived = pool.submit(lambda: "".join(client.stream_grpc(router.grpc_url, *SURVIVOR)))
        assert wait_for(lambda: survived.done()
                        or survivor.metric("trtforge_prompt_tokens_total", "ensemble") > before, 10, 0.01)
        victim.kill()
        with pytest.raises(RuntimeError, match=f"the worker server {victim.grpc} failed this request"):
            for _ in doomed:
                pass
        assert survived.result() == expected[SURVIVOR[0]]
    # the router goes on, leaving the dead worker out: new requests are answered by the survivor
    for p in PROMPTS:
        assert "".join(client.stream_grpc(router.grpc_url, p, MAX_TOKENS)) == expected[p]
