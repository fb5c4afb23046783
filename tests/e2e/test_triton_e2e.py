"""A real tritonserver serving a tiny engine: every path returns the in-process engine's text.

The count of tests here is checked in conftest.EXPECTED_TESTS; keep it in step.
"""

from __future__ import annotations

import queue
import re
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from tests.e2e.helpers import fail_alone, run_cli
from trtforge.model_repo import client
from trtforge.model_repo.launcher import TritonServer
from trtforge.model_repo.pbtxt import read_config

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello world", "The quick brown fox", "Stop strings end a request;", "Café au lait"]
MAX_TOKENS = 12
MODEL = "ensemble"


@dataclass
class Served:
    server: TritonServer
    expected: dict[str, str]
    """Greedy text of each prompt from LLMEngine.generate, the oracle."""
    tokenizer: object
    max_seq_len: int


def _emit_bad_copy(repo: Path) -> None:
    """A second model whose config names an invalid scheduling value (loaded on demand)."""
    config = read_config(repo / MODEL / "config.pbtxt")
    config.name = "bad"
    config.parameters["policy"].string_value = "fastest"
    (repo / "bad" / "1").mkdir(parents=True)
    (repo / "bad" / "config.pbtxt").write_text(text_format.MessageToString(config))
    shutil.copyfile(repo / MODEL / "1" / "model.py", repo / "bad" / "1" / "model.py")


@pytest.fixture(scope="session")
def served(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "repo"))
    _emit_bad_copy(root / "repo")
    server = TritonServer(root / "repo", log_file=root / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"])
    server.start()
    try:
        # Build the oracle while the server loads the same engine.
        from trtforge.config.sampling import SamplingParams
        from trtforge.serving.engine import LLMEngine

        engine = LLMEngine.from_engine_dir(engine_dir)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        expected = {p: o.text for p, o in zip(PROMPTS, outs)}
        server.wait_ready(timeout_s=300)
        yield Served(server, expected, engine.tokenizer, engine.scheduler_config.max_seq_len)
    finally:
        server.stop()


def metrics(served: Served, model: str = MODEL) -> dict[str, float]:
    """trtforge_* samples of a served model, by metric name (+ `le` for buckets)."""
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("trtforge_") and f'model="{model}"' in line:
            name, value = line.rsplit(" ", 1)
            bucket = re.search(r'le="([^"]+)"', name)
            values[name.split("{")[0] + (f"@{bucket.group(1)}" if bucket else "")] = float(value)
    return values


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_grpc_stream_matches_in_process_engine(served):
    for prompt in PROMPTS:
        pieces = list(client.stream_grpc(served.server.grpc_url, prompt, MAX_TOKENS))
        assert "".join(pieces) == served.expected[prompt]
        assert len(pieces) > 1  # streamed, not one final answer


def test_http_generate_matches_in_process_engine(served):
    url = served.server.http_url
    for prompt in PROMPTS[:2]:
        answer = client.generate_http(url, prompt, MAX_TOKENS)
        assert answer["text_output"] == prompt + served.expected[prompt]  # TRT-LLM default
        answer = client.generate_http(url, prompt, MAX_TOKENS, exclude_input_in_output=True,
                                      return_log_probs=True)
        assert answer["text_output"] == served.expected[prompt]
        assert len(answer["output_log_probs"]) == answer["num_output_tokens"]
        assert answer["cum_log_probs"] == pytest.approx(sum(answer["output_log_probs"]), abs=1e-3)


def test_http_generate_stream_matches_in_process_engine(served):
    for prompt in PROMPTS[2:]:
        events = list(client.stream_http(served.server.http_url, prompt, MAX_TOKENS))
        assert "".join(e.get("text_output", "") for e in events) == served.expected[prompt]
        assert len(events) > 1


def test_32_concurrent_streams_are_all_correct(served):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]

    def run(prompt: str) -> str:
        return "".join(client.stream_grpc(served.server.grpc_url, prompt, MAX_TOKENS))

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(run, prompts))
    assert answers == [served.expected[p] for p in prompts]


def test_cancelled_stream_frees_its_kv_blocks(served):
    before = metrics(served)["trtforge_generation_tokens_total"]
    max_tokens = served.max_seq_len - 16
    stream = client.stream_grpc(served.server.grpc_url, "Hello world", max_tokens)
    next(stream), next(stream)
    assert metrics(served)["trtforge_kv_blocks_used"] > 0
    stream.close()  # stop_stream(cancel_requests=True)
    assert wait_for(lambda: metrics(served)["trtforge_kv_blocks_used"] == 0)
    assert metrics(served)["trtforge_requests_running"] == 0
    time.sleep(0.5)  # an un-cancelled request would keep generating
    generated = metrics(served)["trtforge_generation_tokens_total"] - before
    assert generated < max_tokens / 2


def test_bad_requests_fail_alone_while_good_ones_finish(served):
    url, http = served.server.grpc_url, served.server.http_url
    too_long = "hello " * served.max_seq_len
    bad = [
        (lambda: "".join(client.stream_grpc(url, too_long, 4)), "prompt"),
        (lambda: "".join(client.stream_grpc(url, "hi", 0)), "max_tokens=0"),
        (lambda: "".join(client.stream_grpc(url, "hi", 4, beam_width=2)), "beam_width=2"),
        # Numbers as stop words: Triton itself refuses them (stop_words is a STRING input).
        (lambda: client.generate_http(http, "hi", 4, stop_words=[1, 2]), "non-string"),
        # Refused, never shortened: the message gives the most this prompt may ask for.
        (lambda: "".join(client.stream_grpc(url, "hi", 10**6)),
         rf"max_tokens=1000000 exceeds max_seq_len={served.max_seq_len}; send max_tokens <= \d+"),
        # Hostile sampling values: each request fails alone, naming the value.
        (lambda: "".join(client.stream_grpc(url, "hi", 4, end_id=10**9, min_tokens=1)),
         "stop_token_ids contains 1000000000, outside this model's vocabulary"),
        (lambda: "".join(client.stream_grpc(url, "hi", 4, stop_words=[",".join(f"s{i}" for i in range(100))])),
         "at most 64 non-empty strings"),
        (lambda: "".join(client.stream_grpc(url, "hi", 4, temperature=float("nan"))), "temperature=nan"),
    ]
    good = [lambda p=p: "".join(client.stream_grpc(url, p, MAX_TOKENS)) for p in PROMPTS]
    fail_alone(bad, good, [served.expected[p] for p in PROMPTS])


def test_invalid_parameter_fails_model_load_naming_it(served):
    request = urllib.request.Request(
        f"http://{served.server.http_url}/v2/repository/models/bad/load", data=b"{}",
        method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=120)
    message = info.value.read().decode()
    assert "policy='fastest' is invalid" in message and "max_utilization" in message
    # The served model is unaffected.
    assert "".join(client.stream_grpc(served.server.grpc_url, PROMPTS[0], MAX_TOKENS)) \
        == served.expected[PROMPTS[0]]


def _load_busy_model(served: Served, engine_dir: Path, root: Path) -> str:
    """A second model from `emit-repo --max-queue-size 1 --max-batch-size 1`: one request runs,
    one waits, the rest are refused."""
    run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "busy-repo"),
            "--max-queue-size", "1", "--max-batch-size", "1")
    config = read_config(root / "busy-repo" / MODEL / "config.pbtxt")
    assert config.parameters["max_queue_size"].string_value == "1"
    config.name = "busy"
    target = Path(served.server.repo) / "busy"
    shutil.copytree(root / "busy-repo" / MODEL, target)
    (target / "config.pbtxt").write_text(text_format.MessageToString(config))
    request = urllib.request.Request(
        f"http://{served.server.http_url}/v2/repository/models/busy/load", data=b"{}", method="POST")
    urllib.request.urlopen(request, timeout=300).read()
    return "busy"


def _burst(url: str, model: str, prompts: list[str]) -> tuple[dict[int, str], list[tuple[str, float]]]:
    """Send every prompt at once on one gRPC stream. Returns the streamed text of each request
    that finished ({index: text}) and each error with its delay since the burst was sent (an
    error response carries no request id; all were sent at the same instant)."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(url)
    grpc.start_stream(callback=lambda result, error: responses.put((result, error, time.monotonic())))
    texts: dict[int, str] = {}
    done: dict[int, str] = {}
    errors: list[tuple[str, float]] = []
    try:
        sent = time.monotonic()
        for i, prompt in enumerate(prompts):
            inputs = []
            for name, arr in client.request_arrays(prompt, MAX_TOKENS, stream=True).items():
                wire = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32",
                        np.dtype(np.bool_): "BOOL"}[arr.dtype]
                inputs.append(grpcclient.InferInput(name, list(arr.shape), wire))
                inputs[-1].set_data_from_numpy(arr)
            grpc.async_stream_infer(model, inputs, request_id=str(i), enable_empty_final_response=True)
        while len(done) + len(errors) < len(prompts):
            result, error, at = responses.get(timeout=120)
            if error is not None:
                errors.append((str(error), at - sent))
                continue
            response = result.get_response()
            text = result.as_numpy("text_output")
            if text is not None:
                texts[int(response.id)] = texts.get(int(response.id), "") + \
                    b"".join(np.asarray(text).reshape(-1)).decode()
            if response.parameters["triton_final_response"].bool_param:
                done[int(response.id)] = texts.get(int(response.id), "")
    finally:
        grpc.stop_stream()
        grpc.close()
    return done, errors


def test_full_queue_refuses_a_burst_at_once_and_admitted_requests_finish(served, engine_dir,
                                                                         tmp_path):
    model = _load_busy_model(served, engine_dir, tmp_path)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    done, errors = _burst(served.server.grpc_url, model, prompts)
    assert done and errors, f"expected both admitted and refused requests: {done}, {errors}"
    assert done == {i: served.expected[prompts[i]] for i in done}
    for message, delay in errors:
        assert "server busy, retry later" in message and "max_queue_size=1" in message
        assert delay < 1.0, f"a refusal took {delay:.2f} s"
    m = metrics(served, model)
    assert m["trtforge_requests_refused_total"] == len(errors)
    assert wait_for(lambda: metrics(served, model)["trtforge_kv_blocks_used"] == 0)


def test_kv_events_reach_a_zmq_subscriber_in_vllms_format(served, engine_dir, tmp_path):
    """`emit-repo --kv-events-endpoint`: the served model publishes its prefix cache's events as a
    vLLM pod does; a ZMQ subscriber (as llm-d's scheduler) sees the blocks a request computed."""
    import msgspec
    import zmq

    from tests.serving.test_kv_events_zmq import BlockStored, KVEventBatch
    from trtforge.bench.dynamo_fleet import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    run_cli("trtforge", "emit-repo", str(engine_dir), str(tmp_path / "events-repo"), "--kv-events-endpoint",
            endpoint)
    config = read_config(tmp_path / "events-repo" / MODEL / "config.pbtxt")
    assert config.parameters["kv_events_endpoint"].string_value == endpoint
    config.name = "events"
    target = Path(served.server.repo) / "events"
    shutil.copytree(tmp_path / "events-repo" / MODEL, target)
    (target / "config.pbtxt").write_text(text_format.MessageToString(config))
    urllib.request.urlopen(urllib.request.Request(
        f"http://{served.server.http_url}/v2/repository/models/events/load", data=b"{}", method="POST"),
        timeout=300).read()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        time.sleep(0.5)  # a SUB socket sees only what is sent after it joined
        prompt = "the quick brown fox jumps over the lazy dog " * 3
        client.generate_http(served.server.http_url, prompt, 2, model="events")
        ids = served.tokenizer.encode(prompt)
        stored = []
        while sub.poll(2000):
            _, _, payload = sub.recv_multipart()
            stored += [e for e in msgspec.msgpack.decode(payload, type=KVEventBatch).events
                       if isinstance(e, BlockStored)]
        size = stored[0].block_size if stored else 0
        tokens = [t for e in stored for t in e.token_ids]
        assert stored and tokens[:len(ids) // size * size] == ids[:len(ids) // size * size], (stored, ids)
    finally:
        sub.close(linger=0)


def test_request_past_its_deadline_is_aborted_and_frees_its_blocks(served):
    url, n = served.server.grpc_url, served.max_seq_len - 16
    started = time.monotonic()  # how long this server takes for the whole request, no deadline
    assert len(list(client.stream_grpc(url, "Hello world", n, min_tokens=n))) == n
    timeout = max((time.monotonic() - started) / 5, 0.02)
    before = metrics(served)["trtforge_requests_timed_out_total"]
    pieces: list[str] = []
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"deadline exceeded: timeout_s=") as err:
        for piece in client.stream_grpc(url, "Hello world", n, min_tokens=n, timeout_s=timeout):
            pieces.append(piece)
    assert time.monotonic() - started < timeout + 1.0
    assert 0 < len(pieces) < n, f"{len(pieces)} of {n} tokens streamed before: {err.value}"
    assert wait_for(lambda: metrics(served)["trtforge_kv_blocks_used"] == 0)
    m = metrics(served)
    assert m["trtforge_requests_running"] == 0
    assert m["trtforge_requests_timed_out_total"] == before + 1


def test_metrics_then_clean_stop(served):
    m = metrics(served)
    assert m["trtforge_kv_blocks_total"] > 0 and m["trtforge_kv_blocks_used"] == 0
    assert m["trtforge_prompt_tokens_total"] > 0 and m["trtforge_generation_tokens_total"] > 0
    assert m["trtforge_requests_waiting"] == 0
    queried, hits = m["trtforge_prefix_cache_queries_total"], m["trtforge_prefix_cache_hits_total"]
    assert queried > 0 and 0 <= hits <= queried
    assert m["trtforge_prefix_cache_hit_rate"] == pytest.approx(hits / queried, rel=1e-6)
    finished = m["trtforge_time_to_first_token_seconds_count"]
    assert finished >= 32 and m["trtforge_time_per_output_token_seconds_count"] > 0
    assert m["trtforge_time_to_first_token_seconds_bucket@+Inf"] == finished
    # The same gauges under TensorRT-LLM's names, as llm-d's endpoint picker scrapes them.
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    trtllm = {line.split("{")[0] + re.search(r'(request_type|kv_cache_block_type)="([^"]+)"', line).group(2):
              float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("nv_trt_llm_") and f'model="{MODEL}"' in line}
    assert trtllm["nv_trt_llm_request_metricswaiting"] == m["trtforge_requests_waiting"] == 0
    assert trtllm["nv_trt_llm_kv_cache_block_metricsmax"] == m["trtforge_kv_blocks_total"]
    assert trtllm["nv_trt_llm_kv_cache_block_metricsfraction"] == 0.0
    pid = served.server.process.pid
    stubs = _children(pid)
    assert stubs, "the python backend stub should run as a child of tritonserver"
    started = time.monotonic()
    assert served.server.stop() == 0
    assert time.monotonic() - started < 30
    assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in stubs), 10)


def _children(pid: int) -> list[int]:
    kids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            kids.append(int(status.parent.name))
    return kids
